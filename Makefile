# Cilia — the commands DESIGN.md §6 promises. Every target installs what it needs first.
SHELL := /bin/bash
VENV  := .venv
TOX   := $(VENV)/bin/tox

.PHONY: setup test up down cluster-up cluster-down demo bench images lint types clean

setup:
	@scripts/setup.sh

test: setup
	$(TOX) run

lint: setup
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

demo: setup
	@scripts/demo.sh

bench: setup
	$(VENV)/bin/python -m bench

images: setup
	@scripts/images.sh

clean: down
	rm -rf .tox .run build proto/build
