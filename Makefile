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
# The managed hosts' Pythons (tests/config.yml) besides the controller's 3.11 (the venv's): sanity's
# compile and import tests run on each one found.
OTHER_TARGET_PYTHONS := 3.9 3.10 3.12 3.13
SANITY_PYTHONS := $(BUILD)/sanity-pythons

export ANSIBLE_COLLECTIONS_PATH := $(abspath $(COLLECTIONS))
export ANSIBLE_PYTHON_INTERPRETER := $(abspath $(BIN))/python
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test venv lint typecheck sanity pytest schemas bench clean compat changelog release sanity-oldest \
	podresources-stubs

demo: venv
	$(BIN)/python -m meridian_node_agent.dev.demo

# make test's stages, in order; each runs as `make STAGE` through .ci/stage, which prints `stage NAME: 123 s` as it
# ends, and the first that fails stops the rest. molecule last: the slowest part (systemd-booting Debian 11/12/13
# targets; images cached under ~/.cache/meridian-node), after everything that fails faster.
TEST_STAGES := venv lint typecheck compat changelog sanity sanity-oldest pytest molecule

test:
	@for stage in $(TEST_STAGES); do .ci/stage $$stage $(MAKE) --no-print-directory $$stage || exit 1; done

venv: $(VENV)/.installed $(LINK)

$(LINK):
	mkdir -p $(dir $(LINK))
	ln -sfn ../../../.. $(LINK)

# galaxy.yml: the package takes its version from it, so a bump reinstalls.
$(VENV)/.installed: pyproject.toml galaxy.yml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/ansible-lint --offline --profile production playbooks roles molecule

typecheck: venv
	$(BIN)/mypy plugins agent tests bench

# Module code runs on the managed host's Python (3.9+): vermin fails on any construct newer than that.
# It cannot see annotations that pydantic evaluates at run time; tests/system/packaging/test_packaging_host_pythons.py
# imports and runs module_utils on each Python instead.
compat: venv
	$(BIN)/vermin --quiet --no-tips --violations --eval-annotations --target=3.9- plugins tests/system/packaging/host_python_check.py

changelog: venv
	$(BIN)/antsibull-changelog lint

# changelogs/fragments -> CHANGELOG.rst and changelogs/changelog.yaml for galaxy.yml's version (a fragment
# added after that release was made joins it: --update-existing). It lists new modules, plugins and roles
# through ansible-doc, so it runs where Ansible finds the checkout as meridian.node.
release: venv
	cd $(LINK) && $(abspath $(BIN))/antsibull-changelog release --update-existing
	rm -f changelogs/.plugin-cache.yaml

# ansible-test needs the collection at a real .../ansible_collections/meridian/node path, so we
# build the collection artifact and install it there: sanity checks exactly what ships.
# Without --python, ansible-test runs the version-dependent tests (compile, import) on every target Python
# it finds on PATH and the rest once on the controller's: PATH holds the venv (3.11, the controller) and
# the other target Pythons this machine has, real interpreters rather than pyenv shims, and nothing else
# that could answer to python3.X.
sanity: venv $(GET_PIP_CACHE)
	rm -rf $(BUILD)/dist $(SANITY_ROOT) $(SANITY_PYTHONS)
	$(BIN)/ansible-galaxy collection build --force --output-path $(BUILD)/dist . >/dev/null
	$(BIN)/ansible-galaxy collection install --force -p $(SANITY_ROOT) $(BUILD)/dist/meridian-node-*.tar.gz >/dev/null 2>&1
	mkdir -p $(SANITY_PYTHONS)
	@echo "sanity: Python 3.11: $(abspath $(BIN))/python3.11 (the controller)"
	@for version in $(OTHER_TARGET_PYTHONS); do \
		found=; \
		for candidate in $$(command -v python$$version) $(HOME)/.pyenv/versions/$$version.*/bin/python$$version; do \
			found=$$("$$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$$version'.split('.'))); print(sys.executable)" 2>/dev/null) && break; \
		done; \
		if [ -n "$$found" ]; then ln -sfn "$$found" $(SANITY_PYTHONS)/python$$version; echo "sanity: Python $$version: $$found"; \
		else echo "sanity: Python $$version: not on this machine, its compile and import tests are skipped"; fi; \
	done
	# The copy lies inside this git checkout, whose .gitignore hides it from ansible-test; a repository
	# of its own makes ansible-test list the files that ship.
	cd $(SANITY_ROOT)/ansible_collections/meridian/node && git init -q && git add -A && \
		PATH=$(abspath $(SANITY_PYTHONS)):$(abspath $(BIN)):/usr/local/bin:/usr/bin:/bin \
		$(abspath $(BIN))/ansible-test sanity --requirements --color no

# The oldest ansible-core that meta/runtime.yml's requires_ansible admits, in a venv of its own (cached: it
# does not change), running sanity over the same built collection on the controller's Python. Its
# ansible-test bootstraps pip 23.1.2, whose download host is unreachable too: the same shim stands in.
ANSIBLE_OLDEST := 2.16
OLDEST_VENV := $(HOME)/.cache/meridian-node/ansible-core-$(ANSIBLE_OLDEST)-py3.11
OLDEST_ROOT := $(BUILD)/sanity-oldest
OLDEST_GET_PIP := $(HOME)/.ansible/test/cache/get_pip_23_1_2.py

$(OLDEST_VENV)/.installed:
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install --quiet 'ansible-core~=$(ANSIBLE_OLDEST).0'
	touch $@

$(OLDEST_GET_PIP): .ci/get_pip_shim.py
	mkdir -p $(dir $@)
	cp $< $@

sanity-oldest: venv $(OLDEST_VENV)/.installed $(OLDEST_GET_PIP)
	rm -rf $(OLDEST_ROOT)
	$(BIN)/ansible-galaxy collection build --force --output-path $(OLDEST_ROOT)/dist . >/dev/null
	$(BIN)/ansible-galaxy collection install --force -p $(OLDEST_ROOT) $(OLDEST_ROOT)/dist/meridian-node-*.tar.gz >/dev/null 2>&1
	cd $(OLDEST_ROOT)/ansible_collections/meridian/node && git init -q && git add -A && \
		PATH=$(OLDEST_VENV)/bin:/usr/local/bin:/usr/bin:/bin \
		$(OLDEST_VENV)/bin/ansible-test sanity --python 3.11 --requirements --color no

$(GET_PIP_CACHE): .ci/get_pip_shim.py
	mkdir -p $(dir $@)
	cp $< $@

# pytest-xdist: PYTEST_WORKERS workers (auto: tests/support/parallel.py's count for this machine), each test in
# its group (by default its file; GROUPS there for files that must not run side by side). PYTEST_WORKERS=0 runs
# the suite serially.
PYTEST_WORKERS ?= auto
pytest: venv
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup

schemas: venv
	$(BIN)/python -m meridian_node_agent.dev.schemas --write

# docs/CONFIG.md from the agent's config model (tests/agent/test_config_doc.py fails while it is stale).
.PHONY: config-doc
config-doc: venv
	$(BIN)/python -m meridian_node_agent.dev.config_doc --write

# The molecule scenarios (molecule/) on systemd-booting Debian containers, with the images, wheelhouses,
# collections and devserver they need: tests/support/molecule_site.py. `make molecule SCENARIOS=node_agent`
# runs one; MOLECULE_LANES scenarios run side by side (default: one per CPU; MOLECULE_LANES=1, one at a time).
.PHONY: molecule
molecule: venv
	$(BIN)/python -m ansible_collections.meridian.node.tests.support.molecule_site \
		$(if $(MOLECULE_LANES),--lanes $(MOLECULE_LANES)) $(SCENARIOS)

# The kubelet's PodResources API (agent_side/podresources/api.proto) as Python: the message and gRPC stubs and
# their type stubs (mypy-protobuf), checked in. grpcio-tools' protoc decides the protobuf version the stubs
# require at import, so moving grpcio-tools moves the floors of the `kubernetes` extra (pyproject.toml). The sed
# gives each generated module the 'Runs on:' line every file of agent_side/ carries.
PODRESOURCES := agent/meridian_node_agent/agent_side/podresources
podresources-stubs: venv
	cd agent && $(abspath $(BIN))/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. meridian_node_agent/agent_side/podresources/api.proto
	sed -i '0,/^"""\(.*\)"""$$/s//"""\1\n\nRuns on: the agent side (generated from api.proto by make podresources-stubs).\n"""/' \
		$(PODRESOURCES)/api_pb2.py $(PODRESOURCES)/api_pb2_grpc.py

bench: venv
	$(BIN)/python bench/gpu_facts.py
	$(BIN)/python bench/artifact.py
	$(BIN)/python bench/podresources.py

clean:
	rm -rf $(BUILD) $(VENV)
