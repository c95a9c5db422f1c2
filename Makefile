# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-train demo-learn test lint venv clean
.PHONY: check browser

venv: $(STAMP)

# Re-install whenever pyproject.toml changes. torch==2.13.0 resolves to the CPU wheel on local disk.
$(STAMP): pyproject.toml | syslibs
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The 4-cell elastic run: controller here, 4 cell processes and the proxy (with the harnesses) as processes.
demo: $(STAMP)
	rm -rf runs/cluster-cpu
	$(BIN)/gyre run examples/cluster-cpu.toml
	$(BIN)/gyre replay runs/cluster-cpu/log
	$(BIN)/gyre log audit runs/cluster-cpu/log
	$(BIN)/gyre log sql runs/cluster-cpu/log "SELECT cell_id, to_role, count(*) AS switches, \
	  round(avg(duration_s), 2) AS mean_s, sum(redirected_calls) AS redirected, max(weights_bytes) AS weights_bytes \
	  FROM role_switches GROUP BY ALL ORDER BY ALL"

# The single-cell loop (`gyre train`): engine, proxy, harnesses and trainer in one process.
demo-train: $(STAMP)
	rm -rf runs/tiny-cpu
	$(BIN)/gyre train examples/tiny-cpu.toml
	$(BIN)/gyre log sql runs/tiny-cpu/log "SELECT s.step, s.policy_version, round(s.loss, 4) AS loss, \
	  count(r.seq) AS rewards, round(avg(r.reward), 3) AS reward_mean FROM train_steps s \
	  JOIN executions_queued q ON q.policy_version = s.policy_version - 1 AND q.group_id NOT LIKE 'heldout-%' \
	  LEFT JOIN rewards r ON r.execution_id = q.execution_id GROUP BY ALL ORDER BY s.step"

# The learning run (#29): SFT warm start from the scripted expert's demonstrations, then RL with held-out eval.
demo-learn: $(STAMP)
	rm -rf runs/learn
	$(BIN)/gyre sft examples/learn-cpu-sft.toml
	$(BIN)/gyre sft examples/learn-cpu-sft-slips.toml
	$(BIN)/gyre train examples/learn-cpu.toml

# The full suite in two passes: everything but whole runs on both cores (the fast tier, the slow pure tests such
# as the simulator's calibration, and the integration tests of one engine, proxy or harness process), then the
# `serial` part of the integration tier (multi-process cluster runs, training loops, chaos; tests/conftest.py)
# one test at a time, so two of them never split the two cores. A pass that collects nothing fails (exit 5).
FAST_TIER := not integration and not slow and not harness_claude_code
test: $(STAMP)
	$(BIN)/ruff check gyre tests benchmarks agents tasks scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not serial and not harness_claude_code" -n 2 --durations=10; rc=$$?; if [ $$rc -ne 0 ]; then \
	  [ $$rc -eq 5 ] && echo "no tests collected"; exit 1; fi
	$(BIN)/python -m pytest -m "serial and not harness_claude_code" --durations=25; rc=$$?; if [ $$rc -ne 0 ]; then \
	  [ $$rc -eq 5 ] && echo "no tests collected"; exit 1; fi

lint: $(STAMP)
	$(BIN)/ruff check gyre tests benchmarks agents tasks scripts
	$(BIN)/lint-imports --no-cache

# Debian libraries the Mooncake Transfer Engine wheel links against (gyre.transfer), bubblewrap, which
# sandboxes every execution (gyre.harness.bwrap), iproute2, whose `ip netns` makes the hosts of the
# multi-host test (tests/cluster/hosts.py), and nftables, which cuts and loses their links
# (benchmarks/chaos_partition.py); installed only when missing.
MOONCAKE_DEBS := libibverbs1 librdmacm1 libnuma1
SANDBOX_DEBS := bubblewrap
NETNS_DEBS := iproute2 nftables
SYSTEM_DEBS := $(MOONCAKE_DEBS) $(SANDBOX_DEBS) $(NETNS_DEBS)
.PHONY: syslibs
syslibs:
	@command -v dpkg-query >/dev/null || { echo "syslibs: not Debian; install $(SYSTEM_DEBS) by hand"; exit 0; }; \
	missing=$$(for p in $(SYSTEM_DEBS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info

# The fast tier for everyday work: lint, the import contracts (lint-imports; pyproject.toml) plus pure and unit tests
# (under 90 s on 2 cores). `make test` stays the full suite that CI runs; the integration tier is marked in
# tests/conftest.py.
check: $(STAMP)
	$(BIN)/ruff check gyre tests benchmarks agents tasks scripts
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "$(FAST_TIER)" -p no:cacheprovider -n 2

# Debian's chromium, which the report test opens headless (installed once; as root, or through sudo).
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends chromium; }
test: browser
