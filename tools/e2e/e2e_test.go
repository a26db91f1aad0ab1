// Package e2e is Cilia's own build of the upstream Kubernetes network e2e tests (test tooling,
// never shipped): the specs of k8s.io/kubernetes/test/e2e/network and .../network/netpol run by
// the upstream e2e framework against the cluster given with --kubeconfig. Built by
// scripts/e2e-tools.sh into the cache as e2e-network.test; run by tests/k8s/conformance.py
// (make conformance).
package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	testfixtures "k8s.io/kubernetes/test/fixtures"

	// The specs: every [sig-network] test and the NetworkPolicy suite.
	_ "k8s.io/kubernetes/test/e2e/network"
	_ "k8s.io/kubernetes/test/e2e/network/netpol"

	// Framework extensions the upstream suite links in too: dumps on failure, node helpers.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
)

// TestMain registers the framework's flags (--kubeconfig, --provider, --report-dir, the
// ginkgo.* flags, ...), parses them and hands over to the Go test runner.
func TestMain(m *testing.M) {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if flag.CommandLine.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown additional command line arguments: %s\n", flag.CommandLine.Args())
		os.Exit(2)
	}
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	testfiles.AddFileSource(testfixtures.GetTestFixturesFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

// Once per run, on every ginkgo process: the cluster's IP family (read from the ClusterIP of
// the default namespace's "kubernetes" Service), which the network specs branch on.
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte { return nil },
	func(ctx context.Context, _ []byte) {
		c, err := framework.LoadClientset()
		framework.ExpectNoError(err, "loading the client")
		svc, err := c.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
		framework.ExpectNoError(err, "reading the kubernetes Service")
		framework.TestContext.IPFamily = "ipv4"
		if ip := svc.Spec.ClusterIP; len(ip) > 0 && ip[len(ip)-1] != '.' && containsColon(ip) {
			framework.TestContext.IPFamily = "ipv6"
		}
		framework.Logf("Cluster IP family: %s", framework.TestContext.IPFamily)
	})

func containsColon(s string) bool {
	for _, r := range s {
		if r == ':' {
			return true
		}
	}
	return false
}

// TestE2E runs the selected specs (--ginkgo.focus / --ginkgo.skip / --ginkgo.label-filter);
// JUnit goes to --report-dir.
func TestE2E(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	ginkgo.RunSpecs(t, "Cilia: upstream Kubernetes network e2e", suiteConfig, reporterConfig)
}
