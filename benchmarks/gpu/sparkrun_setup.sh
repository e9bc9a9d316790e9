# Sourced by the GPU scripts that go through sparkrun's own CLI (sparkrun_path.sh,
# two_host_path.sh): the plugin installed from the carried wheels, enabled, CRIU and sparkrun
# configured as docs/user-guide.md says, each step timed (steps.sh). They set WORK, SITE, PY,
# STEPS and, on a machine an earlier run set up, SKIP_SETUP=1.
# 1. Install. The user guide's `pip install .` into a venv, done the way this image allows.
if [ -z "${SKIP_SETUP:-}" ]; then
  step install "$PY" -m pip install --quiet --no-deps --no-index --no-compile --upgrade --target "$SITE" "$WORK"/plugin-wheels/*.whl || exit 1
fi
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH SPARKRUN_NO_TELEMETRY=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset SPARKRUN_FEATURE_PLUGINS_COLDSNAP
# From / : the current directory must not shadow the installed plugin.
(cd / && "$PY" -c "import importlib.metadata as m, sparkrun_coldsnap; print('sparkrun', m.version('sparkrun'), '/ sparkrun-coldsnap', m.version('sparkrun-coldsnap'), 'from', sparkrun_coldsnap.__file__)")

# 2. Enable, as the user guide says. sparkrun checks the plugin's exact pins against every
# installed distribution it can see; beside an image's newer packages it refuses. Then the
# feature flag sparkrun reads for a plugin named coldsnap enables it.
if step "plugins enable" sparkrun plugins enable coldsnap; then
  echo "sparkrun enabled the plugin"
else
  echo "sparkrun refused to enable the plugin (above); enabling it with SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1"
  export SPARKRUN_FEATURE_PLUGINS_COLDSNAP=1
fi
step "plugins list" sparkrun plugins list

settings_by_hand() {
  sparkrun setup features enable executor.local || return 1
  sparkrun setup features disable executor.docker || return 1   # no docker daemon here
  local reg
  for reg in $(sparkrun registry list 2>/dev/null | awk '/^---/ {t=1; next} t && / yes / {print $1}'); do
    sparkrun registry disable "$reg" >/dev/null 2>&1 && echo "recipe registry $reg disabled (unreachable from here)"
  done
  # sparkrun's first-run discovery of registries stays pending, and every command then retries
  # cloning them: marked done, as `setup --sparkrun` does on a host without internet.
  "$PY" -c 'from sparkrun_coldsnap.integration.registries import settle_pending_bootstrap as s; print("registry discovery marked done" if s() else "no registry discovery pending")' || return 1
  # The greedy scheduler: sparkrun 0.4.2 gives new clusters occupancy-sparse, which draws a new
  # placement token (part of the workload's cluster id) at every launch, and the lifecycle verbs
  # (lifecycle.sh) then find no workload for the recipe.
  if sparkrun cluster list 2>/dev/null | grep -q coldsnap-local; then
    sparkrun cluster update coldsnap-local --scheduler greedy
  else
    sparkrun cluster create coldsnap-local -H localhost --executor local --default --scheduler greedy
  fi
}

# 3. Configure: CRIU from the carried packages, then sparkrun's settings (`setup --sparkrun`:
# the plugin enabled, the local executor on, the docker executor off without a daemon,
# unreachable recipe registries off, a default cluster on localhost).
if [ -n "${SKIP_SETUP:-}" ]; then
  echo "CRIU and sparkrun's settings: as the earlier run on this machine left them"
elif ! step "setup --criu" sparkrun coldsnap setup --criu --criu-debs "$WORK/criu-debs"; then
  exit 1
elif ! step "setup --sparkrun" sparkrun coldsnap setup --sparkrun; then
  # Its first step is `sparkrun plugins enable coldsnap`, refused as above: the rest by hand.
  echo "setup --sparkrun stopped at enabling the plugin; its other steps, one by one:"
  step "settings by hand" settings_by_hand
fi
[ -n "${SKIP_SETUP:-}" ] || step "doctor" sparkrun coldsnap doctor

