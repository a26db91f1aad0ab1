// testpod is the one program in the test image that tests/e2e/test_kubelet_pod.py runs in
// real Pods started by a kubelet through containerd (test tooling, never shipped):
//
//	testpod pause            block until SIGTERM or SIGINT (the sandbox "pause" process)
//	testpod serve PORT...    answer every TCP connection on each PORT with
//	                         "hello from <hostname> on <port>\n", then close it; a PORT
//	                         written grpc:N instead serves the gRPC health service
//	                         (grpc.health.v1.Health/Check answers SERVING) on N over
//	                         cleartext HTTP/2, for a kubelet's gRPC readiness probe
//
// It is built statically (CGO_ENABLED=0) by scripts/kubelet-tools.sh; the testkit packs it
// into an OCI image tarball (lib/testkit/src/cilia_testkit/kubelet.py) that is imported into
// the test's own containerd, so no registry is needed.
package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// healthCheck answers grpc.health.v1.Health/Check with SERVING: one length-prefixed message
// (flag 0, 4-byte big-endian length) holding HealthCheckResponse{status: SERVING}, i.e.
// field 1 varint 1 = 0x08 0x01, then the trailer grpc-status 0 (gRPC over HTTP/2).
func healthCheck(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/grpc.health.v1.Health/Check" {
		w.Header().Set("Content-Type", "application/grpc")
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "12") // UNIMPLEMENTED
		return
	}
	w.Header().Set("Content-Type", "application/grpc")
	w.WriteHeader(http.StatusOK)
	w.Write([]byte{0, 0, 0, 0, 2, 0x08, 0x01})
	w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
}

func serveGRPCHealth(port string) error {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	server := &http.Server{Addr: ":" + port, Handler: http.HandlerFunc(healthCheck), Protocols: &protocols}
	ln, err := net.Listen("tcp", server.Addr)
	if err != nil {
		return err
	}
	fmt.Printf("grpc health on %s\n", ln.Addr())
	go server.Serve(ln)
	return nil
}

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
			if grpcPort, ok := strings.CutPrefix(port, "grpc:"); ok {
				if err := serveGRPCHealth(grpcPort); err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
				continue
			}
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
