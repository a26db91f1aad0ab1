// testpod is the one program in the test image that tests/e2e/test_kubelet_pod.py runs in
// real Pods started by a kubelet through containerd (test tooling, never shipped):
//
//	testpod pause            block until SIGTERM or SIGINT (the sandbox "pause" process)
//	testpod serve PORT...    answer every TCP connection on each PORT with
//	                         "hello from <hostname> on <port>\n", then close it
//
// It is built statically (CGO_ENABLED=0) by scripts/kubelet-tools.sh; the testkit packs it
// into an OCI image tarball (lib/testkit/src/cilia_testkit/kubelet.py) that is imported into
// the test's own containerd, so no registry is needed.
package main

import (
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testpod pause | testpod serve PORT...")
		os.Exit(2)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	switch os.Args[1] {
	case "pause":
	case "serve":
		host, _ := os.Hostname()
		for _, port := range os.Args[2:] {
			ln, err := net.Listen("tcp", ":"+port)
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			fmt.Printf("listening on %s\n", ln.Addr())
			go func(ln net.Listener, port string) {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					fmt.Fprintf(c, "hello from %s on %s\n", host, port)
					c.Close()
				}
			}(ln, port)
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
	<-stop
}
