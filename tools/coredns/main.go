// Command coredns is CoreDNS (github.com/coredns/coredns, pinned in go.mod) linked with only
// the plugins the test cluster's Corefile uses (cilia_testkit.kind.coredns): a plugin
// registers itself from its package's init, so importing it is what enables it; the order of
// plugins in a server block comes from CoreDNS's own dnsserver.Directives list.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() {
	coremain.Run()
}
