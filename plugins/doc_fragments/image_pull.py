"""The options the engine modules share for bringing an engine's image onto the host (issue 26).

``engine_instance`` and ``engine_set`` take them from ``module_utils/engines/args.py``'s ``RUN_OPTIONS``; this is
their one description.
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
"""
