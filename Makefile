# Two entry points for a fresh clone: `make demo` and `make test`.
# torch is pinned to the 2.13.0 CPU wheel and installed first, so pip never resolves a CUDA build.
# Two environments: $(VENV) has the transformers users install today (5.x) and runs the whole suite;
# $(COMPAT) has litgpt, whose pins pull transformers 4.x, and runs the model-family tests again there.
VENV   ?= .venv
COMPAT ?= .venv-compat
PY     := $(VENV)/bin/python
PY4    := $(COMPAT)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
STAMP4 := $(COMPAT)/.installed
COMPAT_TESTS ?= tests/test_hf.py tests/test_experts.py tests/test_grouped_experts.py tests/test_expert_load.py tests/test_selective.py tests/test_context.py tests/test_layout.py tests/test_kernels_inject.py

.PHONY: venv venvs demo test test-main test-compat test-fast bench clean

venv: $(STAMP)

PIP := pip install -q
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m $(PIP) $(TORCH)
	$(PY) -m $(PIP) -c .ci/constraints.txt -e '.[test,hf]'
	touch $(STAMP)

$(STAMP4): pyproject.toml Makefile
	python3 -m venv $(COMPAT)
	$(PY4) -m $(PIP) $(TORCH)
	$(PY4) -m $(PIP) -c .ci/constraints.txt -e '.[test,hf,litgpt]'
	touch $(STAMP4)

# both environments at once (pip uses one core each)
venvs:
	$(MAKE) -j2 $(STAMP) $(STAMP4)

# extra LightningCLI flags, e.g. make demo ARGS="--trainer.strategy.init_args.pp=2"
demo: $(STAMP)
	$(PY) examples/gpt/demo.py $(ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the suite. Two pytest workers, a test
# file each at a time (--dist loadfile: a file's launches run once, in one worker). The suite keeps both
# cores busy (measured: ~100% over a run), so more workers or a third pytest do not make it shorter.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
# both suites run even when the first fails; the exit status is a failure if either failed
test: venvs
	@rc=0; $(MAKE) test-main || rc=1; $(MAKE) test-compat || rc=1; exit $$rc

test-main: $(STAMP)
	$(PY) -m pytest tests $(XDIST) --durations=30; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# the compat run: model families only (LTP_FAMILIES_ONLY: tests/models.py's runnable tables leave this
# project's own models to the main run, which ran them on the same torch and lightning)
test-compat: $(STAMP4)
	LTP_FAMILIES_ONLY=1 $(PY4) -m pytest $(COMPAT_TESTS) $(XDIST); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# the inner loop: the main environment without the tests marked slow (torchrun agents, whole scripts)
test-fast: $(STAMP)
	$(PY) -m pytest tests $(XDIST) -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) $(COMPAT) build *.egg-info
