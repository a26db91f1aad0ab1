# Cilia — the commands DESIGN.md §6 promises. Every target installs what it needs first.
SHELL := /bin/bash
VENV  := .venv
TOX   := $(VENV)/bin/tox

.PHONY: setup test up down demo bench images lint types clean

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

demo: setup
	@scripts/demo.sh

bench: setup
	$(VENV)/bin/python -m bench

images: setup
	@scripts/images.sh

clean: down
	rm -rf .tox .run build proto/build
