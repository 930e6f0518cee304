PY ?= python

.PHONY: install test serve

install:
	bash .ci/install

test:
	$(PY) -m pytest -q -x tests

serve:
	pagedserve serve
