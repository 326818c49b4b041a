# The two commands: `make demo` (the main job) and `make test` (everything CI checks).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BUILD := .build
COLLECTIONS := $(BUILD)/collections
LINK := $(COLLECTIONS)/ansible_collections/meridian/node
SANITY_ROOT := $(BUILD)/sanity
GET_PIP_CACHE := $(HOME)/.ansible/test/cache/get_pip_24_2.py

export ANSIBLE_COLLECTIONS_PATH := $(abspath $(COLLECTIONS))
export ANSIBLE_PYTHON_INTERPRETER := $(abspath $(BIN))/python
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test venv lint typecheck sanity pytest schemas bench clean

demo: venv
	$(BIN)/python -m meridian_node_agent.demo

test: venv lint typecheck sanity pytest

venv: $(VENV)/.installed $(LINK)

$(LINK):
	mkdir -p $(dir $(LINK))
	ln -sfn ../../../.. $(LINK)

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ansible-lint --offline --profile production playbooks roles

typecheck: venv
	$(BIN)/mypy plugins agent tests bench

# ansible-test needs the collection at a real .../ansible_collections/meridian/node path, so we
# build the collection artifact and install it there: sanity checks exactly what ships.
sanity: venv $(GET_PIP_CACHE)
	rm -rf $(BUILD)/dist $(SANITY_ROOT)
	$(BIN)/ansible-galaxy collection build --force --output-path $(BUILD)/dist . >/dev/null
	$(BIN)/ansible-galaxy collection install --force -p $(SANITY_ROOT) $(BUILD)/dist/meridian-node-*.tar.gz >/dev/null 2>&1
	# The copy lies inside this git checkout, whose .gitignore hides it from ansible-test; a repository
	# of its own makes ansible-test list the files that ship.
	cd $(SANITY_ROOT)/ansible_collections/meridian/node && git init -q && git add -A && \
		$(abspath $(BIN))/ansible-test sanity --python 3.11 --requirements --color no

$(GET_PIP_CACHE): .ci/get_pip_shim.py
	mkdir -p $(dir $@)
	cp $< $@

pytest: venv
	$(BIN)/pytest

schemas: venv
	$(BIN)/python -m meridian_node_agent.schemas --write

bench: venv
	$(BIN)/python bench/gpu_facts.py
	$(BIN)/python bench/artifact.py

clean:
	rm -rf $(BUILD) $(VENV)
