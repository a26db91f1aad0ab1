# Cilia — the commands the README promises. Every target installs what it needs first.
SHELL := /bin/bash
VENV  := .venv
TOX   := $(VENV)/bin/tox

.PHONY: setup test-setup bpf cni-shim test up down cluster-up cluster-down k8s-up k8s-down k8s-status k8s-install k8s-uninstall k8s-e2e seed-story conformance demo bench images lint types clean

# setup: what the demo and the local stacks need (minutes on a fresh machine);
# test-setup: that plus the tools only the tests use (Go builds, cached by version).
setup:
	@scripts/setup.sh
	@$(MAKE) --no-print-directory bpf cni-shim

test-setup:
	@scripts/setup.sh --test-tools
	@$(MAKE) --no-print-directory bpf cni-shim

# The cilia-cni executable the runtime execs on the host (services/cni/shim): one C file,
# linked statically (glibc's libc.a from libc6-dev), so it runs whatever libc a host has.
CNI_SHIM    := build/cni/cilia-cni
SHIM_CC     ?= cc
SHIM_CFLAGS := -static -Os -s -Wall -Wextra -Werror -D_FORTIFY_SOURCE=2
cni-shim: $(CNI_SHIM)

$(CNI_SHIM): services/cni/shim/cilia-cni.c
	@mkdir -p $(@D)
	$(SHIM_CC) $(SHIM_CFLAGS) $< -o $@.tmp && mv $@.tmp $@

# The eBPF programs, compiled ahead of time (the agent loads build/bpf/*.o with libbpf and
# configures them at load: map sizes and each program's CONFIG). clang-14 and libbpf-dev come
# from Debian (scripts/setup.sh); the uapi headers from linux-libc-dev.
BPF_SRCS   := $(wildcard bpf/bpf_*.c)
BPF_OBJS   := $(patsubst bpf/%.c,build/bpf/%.o,$(BPF_SRCS))
BPF_CC     ?= clang-14
BPF_CFLAGS := -O2 -g -target bpf -Wall -Werror -I bpf -I/usr/include/$(shell uname -m)-linux-gnu
# bpf_sock_compat.o: the socket-LB for kernels without bpf_set_retval (< 5.18), the same source
# with CILIA_NO_SET_RETVAL; the agent picks it at load time from a probe (--bpf-sock-variant).
BPF_OBJS   += build/bpf/bpf_sock_compat.o
bpf: $(BPF_OBJS)

build/bpf/%.o: bpf/%.c $(wildcard bpf/lib/*.h)
	@mkdir -p $(@D)
	$(BPF_CC) $(BPF_CFLAGS) -c $< -o $@.tmp && mv $@.tmp $@

build/bpf/bpf_sock_compat.o: bpf/bpf_sock.c $(wildcard bpf/lib/*.h)
	@mkdir -p $(@D)
	$(BPF_CC) $(BPF_CFLAGS) -DCILIA_NO_SET_RETVAL -c $< -o $@.tmp && mv $@.tmp $@

test: test-setup
	$(TOX) run

lint: test-setup
	$(TOX) run -e lint,types,proto

up: setup
	@scripts/stack.sh up

down:
	@scripts/stack.sh down

# A multi-node cluster on this host (each node a netns with its own agent): NODES=3 ROUTING=native|tunnel
NODES   ?= 3
ROUTING ?= native
cluster-up: setup
	@scripts/cluster.sh up --nodes $(NODES) --routing $(ROUTING)

cluster-down:
	@scripts/cluster.sh down

# A real Kubernetes cluster, kind-style: each node a container of the node image (containerd +
# kubelet; the control plane in the first), no kube-proxy, CoreDNS, an "outside" host.
# NODES=3 K8S_NAME=cilia K8S_CNI=none|reference (none: nodes stay NotReady until a CNI is installed).
# State and kubeconfig in .run/k8s/$(K8S_NAME)/ (see lib/testkit: cilia_testkit.kind).
K8S_NAME ?= cilia
K8S_CNI  ?= none
# k8s-up also builds Cilia's images and loads them into the nodes (no registry here), then
# prints the helm install command; k8s-install runs it and waits until everything is Ready.
k8s-up: test-setup
	@$(VENV)/bin/python -m cilia_testkit.kind up --name $(K8S_NAME) --nodes $(NODES) --cni $(K8S_CNI)
	@if [ "$(K8S_CNI)" = none ]; then $(VENV)/bin/python -m cilia_testkit.kind.installctl images --name $(K8S_NAME); fi

k8s-install:
	@$(VENV)/bin/python -m cilia_testkit.kind.installctl install --name $(K8S_NAME)

k8s-uninstall:
	@$(VENV)/bin/python -m cilia_testkit.kind.installctl uninstall --name $(K8S_NAME)

# The whole Kubernetes suite (tests/k8s, every test); make test runs the part not marked long.
k8s-e2e: test-setup
	$(TOX) run -e k8s -- -m ""

# The seed story (issue 30, tests/k8s/test_seed_story.py): a fresh 3-node cluster, Cilia
# installed, the Service range changed from 10.96.0.0/16 to 10.100.0.0/16 while clients on
# every node send HTTP, DNS and API requests; prints the counts (0 failed) and the steps'
# output; the cluster is torn down at the end. KIND_LOCK=FILE: hold that flock meanwhile (a
# machine shared by several clusters' users).
KIND_LOCK ?=
seed-story: test-setup
	$(if $(KIND_LOCK),flock $(KIND_LOCK)) $(TOX) run -e k8s -- -m long -k test_seed_story -s -p no:cacheprovider

# Cilia judged by the upstream Kubernetes network e2e suite (tests/k8s/conformance.py; the
# table lands in docs/conformance.md, JUnit in .run/conformance/<suite>/). Builds e2e-network.test
# and agnhost (scripts/e2e-tools.sh) and the images the specs run; a new 3-node cluster
# "cilia-conf" (torn down at the end), or the recorded cluster K8S_NAME=... given explicitly
# (kept). CONFORMANCE_SUITES: any of conformance netpol services; CONFORMANCE_PROCS: parallel
# ginkgo processes (1: serial).
CONFORMANCE_SUITES ?= conformance
CONFORMANCE_PROCS  ?= 1
conformance: test-setup
	@$(VENV)/bin/python tests/k8s/conformance.py --nodes $(or $(NODES),3) \
	  --name $(if $(filter command line environment,$(origin K8S_NAME)),$(K8S_NAME),cilia-conf) \
	  --procs $(CONFORMANCE_PROCS) $(foreach s,$(CONFORMANCE_SUITES),--suite $(s))

k8s-down:
	@$(VENV)/bin/python -m cilia_testkit.kind down --name $(K8S_NAME)

k8s-status:
	@$(VENV)/bin/python -m cilia_testkit.kind status --name $(K8S_NAME)

demo: setup
	@scripts/demo.sh

bench: test-setup
	$(VENV)/bin/python -m bench

images: test-setup
	@scripts/images.sh

clean: down k8s-down
	rm -rf .tox .run build proto/build
