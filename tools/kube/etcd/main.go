// Command etcd is the etcd server, built from the go.etcd.io/etcd/server/v3 module for Cilia's
// tests only (the real kube-apiserver fixture stores its state in it). Never shipped.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
