# One command each: `make demo` sets everything up and runs the CPU demo;
# `make test` sets everything up and runs the test suite.
PY := .venv/bin/python

.PHONY: setup demo test
setup:
	bash tools/setup_env.sh

demo: setup
	$(PY) tools/demo.py

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests
