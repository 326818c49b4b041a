"""The options ``engine_instance`` and ``engine_set`` share, described once: how a run brings an engine's image
onto the host (issue 26), waits for readiness and replaces a running engine.

Both take them from ``module_utils/engines/args.py``'s ``RUN_OPTIONS``. Options whose descriptions differ between
the two (the timeouts, C(store_path), C(owner)) stay in each module.
"""


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  pull:
    description:
      - V(missing) pulls an engine's image by its digest when the local Docker Engine lacks it, before anything is
        drained or stopped.
      - V(never) refuses such an engine instead (C(check=image-missing)), in check mode too, without asking any
        registry - what an air-gapped host wants, whose images come in its bundles (the air-gap playbook sets it).
    type: str
    choices: [missing, never]
    default: missing
  progress_file:
    description:
      - A file to keep the byte progress of this run's image pulls in while they run (JSON, replaced at most once a
        second, mode 0640, group its directory's), for the pull agent to show in its observations and status.
      - Its directory must be a real directory owned by the user the module runs as and writable by no one else;
        otherwise no progress is written and the pull's C(image_pull.progress_problem) says why. Pulls run the
        same either way.
    type: path
  replace_beside:
    description:
      - Replace a running engine beside its old container when the host has room (a free port of the policy's
        C(engines.port_range), and the new engine's GPUs and VRAM besides the old one's) - the new container
        starts on the free port, serves once ready, the old one drains and stops, and the engine keeps the new
        port. Right where whatever routes to the engine follows the serving projection (the pull agent's
        reconcile sets it); leave it off when something routes to the spec's port (a static load balancer).
      - Off, or without room, a replace stops the old engine but keeps it until the new one is ready, and starts
        it again if the new one fails; the engine keeps its port.
    type: bool
    default: false
  drain_settle:
    description:
      - Seconds a drained engine keeps serving after it is marked draining, before its in-flight gauges are
        trusted - time for whoever routes to it (the pull agent's observation, the serving projection, a
        gateway) to stop sending it new work. 0 trusts the gauges at once, right for callers that route by
        nothing else.
    type: int
    default: 0
  wait_ready:
    description:
      - Wait after every start until the engine's readiness probe passes.
    type: bool
    default: true
"""
