#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: engine_instance
short_description: Run an inference engine (vLLM, TGI, SGLang, Ollama, llama.cpp, LMDeploy, ...) as a container
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Makes one inference engine present, started, stopped or absent as a Docker container, built by the
    engine's driver from one generic spec (the C(EngineSpec) contract).
  - Every check runs before anything changes - the spec, the host policy (image repository allowed and
    pinned by digest, driver allowed, port inside the policy's range), the promoted model artifact, the
    container's ownership, then for a new container the image, the GPUs or MIG instances (not cordoned, and
    not of C(unhealthy) or C(unknown) health unless O(force) - see C(docs/GPU_HEALTH.md)), free VRAM after
    the reservations of the other engines this collection owns, the port on the policy's bind address and
    the NVIDIA runtime. A refused engine leaves the host exactly as it was, and the message names the
    check with the numbers.
  - Only containers with meridian.node's ownership labels are touched. A container with the engine's name
    but without them makes the module fail and is left alone.
  - Under a cordon (the host's, from M(meridian.node.cordon), or the policy's) no new container is created on a
    cordoned GPU, nor anywhere on a cordoned node. A cordon with drain holds an engine to be started - it is
    drained and stopped if it runs, never created or started while the cordon lasts (RV(held)). Once no
    cordon holds it, it is started and its cordon's draining mark cleared. See C(docs/CORDON.md).
  - A re-run with the same spec changes nothing. A changed spec (any option that shapes the container, the
    restart policy, shared memory, limits, volumes and labels included) replaces the container; with
    O(replace_strategy=drain-then-replace) the old engine is first marked draining (durably, under
    O(state_dir)) and given until its running and waiting requests reach zero.
  - A container changed by hand is replaced the same way - its live settings (image, command, env,
    ports, GPUs, mounts, restart policy, memory and CPU limits...) are read back and compared with those
    it would be created with, since C(docker update) keeps the config hash label and a container recreated
    by hand can carry it. RV(drifted) names the settings.
  - With O(wait_ready=true) the module waits until the engine's readiness probe passes. An engine that is
    not ready within O(ready_timeout) is stopped (never left half-running) and the module fails with the
    last probe result and the container's last log lines.
  - Docker restarts an engine by itself under its O(restart_policy) (by default V(unless-stopped) - after a
    crash and when the host boots - but never one that was stopped on purpose, by a drain or O(state=stopped)).
  - Extra O(volumes) are always mounted read-only, and only from host directories the policy's
    C(engines.allowed_volume_sources) lists; O(ipc_mode=host) runs only where the policy sets
    C(engines.allow_host_ipc). Both rules hold for every caller, a playbook as much as a signed desired state.
requirements:
  - PyYAML on the managed host (to read the policy), and a Docker Engine (API 1.41 or newer) reached through
    its socket or E(DOCKER_HOST); no other Python package is needed.
  - A Docker Engine (API 1.41 or newer), reached through its socket or E(DOCKER_HOST); the Docker SDK is not needed.
  - nvidia-ml-py on hosts whose engines ask for GPUs.
options:
  name:
    description:
      - The engine's name, also the container's name (1-63 lowercase letters, digits, C(.), C(_), C(-)).
    type: str
    required: true
  state:
    description:
      - V(started) - the container exists with this spec and runs (and is ready, with O(wait_ready)).
      - V(present) - the container exists with this spec; a running one is kept running, a new one is not started.
      - V(stopped) - the container exists with this spec and does not run.
      - V(absent) - no container; only O(name) is needed.
    type: str
    choices: [present, started, stopped, absent]
    default: started
  driver:
    description:
      - The engine. Required unless O(state=absent).
    type: str
    choices: [vllm, tgi, sglang, ollama, llamacpp, lmdeploy, openai]
  image:
    description:
      - The engine image, C(repository[:tag]@sha256:<digest>), allowed by the policy. Required unless
        O(state=absent).
      - When the container is to be created and the local Docker Engine lacks the image, it is pulled by its
        digest (never a tag), with the credentials of the policy's C(images.registry_auth_file), after every
        other check and before anything is drained or stopped, then verified (its registry digest must be
        exactly this one). A pull whose progress stops for C(images.pull_stall_seconds) is cancelled
        (check C(image-pull-stalled)); one that would leave less than C(images.min_free_bytes) free under
        Docker's data-root is refused before it starts (check C(disk-low)). Check mode pulls nothing and
        reports the pull it would make (RV(image_pull)).
    type: str
  model:
    description:
      - The model to serve - exactly one of O(model.artifact) or O(model.name). Required unless O(state=absent).
    type: dict
    suboptions:
      artifact:
        description:
          - A model artifact promoted in the local store (C(<store>/artifacts/<artifact>/current)); it is
            mounted read-only into the container.
        type: str
      name:
        description:
          - A model name, for engines that fetch and manage their own models.
        type: str
  served_model_name:
    description:
      - The model name clients use. Defaults to the model name, else the engine's name.
    type: str
  gpus:
    description:
      - GPUs by uuid or index, or MIG instances by uuid. Empty runs the engine without any GPU.
    type: list
    elements: str
    default: []
  min_vram_mib:
    description:
      - Free VRAM, in MiB, that each requested GPU or MIG instance must have for this engine, after the
        reservations of the other engines this collection owns. Recorded on the container as its reservation.
    type: int
    default: 0
  force:
    description:
      - Place the engine on GPUs whose health verdict is C(unhealthy) or C(unknown), which placement otherwise
        refuses (C(check=placement-health)). The run then warns, naming each such GPU and its reasons, in its
        warnings, RV(placement_warnings) and the diff. A cordoned GPU is refused whatever this says.
      - How to place, not what the container is - changing it alone replaces nothing.
    type: bool
    default: false
  port:
    description:
      - The host port the engine is published on, on the policy's bind address. Required unless O(state=absent).
    type: int
  args:
    description:
      - Extra engine arguments. Flags the driver sets itself (port, host, model, served name) are refused.
    type: list
    elements: str
    default: []
  env:
    description:
      - Environment variables for the engine, shown whole in the diff and the result (RV(diff)). Put a value
        that must stay secret in O(secret_env) instead.
      - Values are strings; quote V(1), V(0) and V(true) in YAML.
      - Part of the container's settings - changing one replaces the container.
    type: dict
    default: {}
  secret_env:
    description:
      - Environment variables whose values only the container sees. The option is C(no_log), the diff and
        the result show each name beside V(<secret>), labels carry the names only, and the config hash covers
        a sha256 of each value, so that changing a secret replaces the container and RV(diff) shows it as a
        changed C(config_hash).
      - A name may not be in both O(env) and O(secret_env).
      - Ansible masks a C(no_log) value wherever it occurs in the task's output, so a very short secret stars
        that text elsewhere too; from a signed desired state (C(reconcile.yml)) the values never pass through
        task arguments and nothing is masked by content below 6 characters.
      - The hash of a guessable value (a short word, a small number) can be guessed back from the config hash;
        use secrets with real entropy (tokens, keys).
    type: dict
    default: {}
  restart_policy:
    description:
      - When Docker starts the engine's container again by itself, without this module or the agent.
      - V(unless-stopped) - after the engine exits or crashes, and when dockerd (the host) restarts; not after
        a drain, O(state=stopped) or a failed readiness wait stopped it.
      - V(on-failure) - only after the engine exits with an error.
      - V(no) - never (quote it in YAML, C("no"), or it reads as a boolean).
      - Part of the container's settings - changing it replaces the container.
    type: str
    choices: ["no", on-failure, unless-stopped]
    default: unless-stopped
  shm_size_mib:
    description:
      - The size of the container's C(/dev/shm), in MiB. Engines that split a model across GPUs share
        tensors there; the default is the driver's (see docs/ENGINE_DRIVERS.md), else Docker's 64 MiB.
      - Not with O(ipc_mode=host), where the host's C(/dev/shm) is used.
    type: int
  ipc_mode:
    description:
      - V(private) - the engine has its own IPC namespace and C(/dev/shm).
      - V(host) - the engine shares the host's IPC namespace and shared memory, and so every other such
        engine's. Refused unless the policy sets C(engines.allow_host_ipc=true).
    type: str
    choices: [private, host]
    default: private
  ulimits:
    description:
      - Resource limits by name (C(core), C(memlock), C(nofile), C(nproc), C(stack)), each one number for the
        soft and the hard limit or C({soft, hard}); V(-1) is unlimited. NVIDIA's containers recommend
        C(memlock=-1) and C(stack=67108864). They are merged over the driver's defaults.
    type: dict
    default: {}
  volumes:
    description:
      - Host paths mounted read-only into the engine (there is no writable form).
      - The host path must be absolute, at or below one of the policy's C(engines.allowed_volume_sources),
        and must not overlap host configuration, C(/proc), C(/sys), C(/dev), C(/run), container runtimes'
        state or meridian.node's own directories, also after its symlinks are resolved. Sockets and device
        nodes are refused.
    type: list
    elements: dict
    default: []
    suboptions:
      source:
        description:
          - The host path (a directory or a regular file).
        type: str
        required: true
      target:
        description:
          - Where it appears inside the container; not under C(/meridian), C(/proc), C(/sys) or C(/dev).
        type: str
        required: true
  labels:
    description:
      - Labels of the engine's own on its container, such as C(com.example.team). Keys starting with
        C(meridian.node) and Docker's reserved C(com.docker.), C(io.docker.) and C(org.dockerproject.) are refused.
      - Part of the container's settings - changing them replaces the container.
    type: dict
    default: {}
  health_path:
    description:
      - The readiness path of a generic O(driver=openai) server (default C(/v1/models)). Not for other drivers.
    type: str
  replace_strategy:
    description:
      - How a running engine is replaced when its spec changes.
      - V(drain-then-replace) - mark it draining, wait until nothing is in flight (or fail after
        O(drain_timeout), leaving it running), then stop it and start the new one.
      - V(stop-then-start) - stop it at once; requests in flight are lost on engines that abort them.
    type: str
    choices: [drain-then-replace, stop-then-start]
    default: drain-then-replace
  ready_timeout:
    description:
      - Seconds to wait for readiness (model loading included).
    type: int
    default: 600
  drain_timeout:
    description:
      - Seconds to wait for in-flight requests to finish when draining before a replacement.
    type: int
    default: 300
  drain_grace:
    description:
      - Seconds to wait when draining an engine that publishes no in-flight metrics (Ollama, generic servers).
    type: int
    default: 10
  store_path:
    description:
      - The artifact store to resolve O(model.artifact) in. Defaults to the policy's C(store.path).
    type: path
  owner:
    description:
      - Who converges this engine, recorded in the container's C(meridian.node/owner) label. The reconcile
        playbook sets C(agent:<node id>) so that it removes only engines it started itself; M(meridian.node.engine_info)
        filters on it with O(meridian.node.engine_info#module:owner).
      - Part of the container's settings - changing it replaces the container.
    type: str
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.diff
  - meridian.node.host
  - meridian.node.engine
  - meridian.node.attributes.action
notes:
  - Containers are created from the image id the reference resolved to, so what runs is what was checked.
  - A stopped engine keeps its VRAM reservation; remove it (O(state=absent)) to release it.
seealso:
  - name: Engine drivers
    description: What each driver runs and where its facts come from (docs/ENGINE_DRIVERS.md).
    link: https://github.com/meridian/node/blob/main/docs/ENGINE_DRIVERS.md
"""

EXAMPLES = r"""
- name: Serve a promoted artifact with vLLM on two GPUs
  meridian.node.engine_instance:
    name: llama-70b
    driver: vllm
    image: registry.example.com/vllm/vllm-openai@sha256:4f5c0a6a0e0e7f1d2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
    model:
      artifact: llama-3-70b-instruct
    served_model_name: llama-70b
    gpus: ["0", "1"]
    min_vram_mib: 70000
    port: 8001
    env:
      VLLM_LOGGING_LEVEL: INFO
    secret_env:
      HF_TOKEN: "{{ vault_hf_token }}"

- name: Serve SGLang on four GPUs with a larger /dev/shm, a read-only tokenizer directory and a team label
  meridian.node.engine_instance:
    name: qwen-72b
    driver: sglang
    image: registry.example.com/lmsysorg/sglang@sha256:4f5c0a6a0e0e7f1d2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
    model:
      artifact: qwen-2-72b-instruct
    gpus: ["0", "1", "2", "3"]
    port: 8002
    shm_size_mib: 65536  # the sglang driver's default is 32768
    ulimits:
      nofile: 1048576
    volumes:
      - source: /srv/models/tokenizers  # under the policy's engines.allowed_volume_sources
        target: /data/tokenizers
    labels:
      com.example.team: search

- name: Stop an engine, keeping its container
  meridian.node.engine_instance:
    name: llama-70b
    state: stopped
    driver: vllm
    image: registry.example.com/vllm/vllm-openai@sha256:4f5c0a6a0e0e7f1d2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
    model:
      artifact: llama-3-70b-instruct
    port: 8001

- name: Remove an engine
  meridian.node.engine_instance:
    name: llama-70b
    state: absent
"""

RETURN = r"""
actions:
  description: The actions planned, in order (in check mode, the ones that would run).
  returned: always
  type: list
  elements: str
  sample: [drain, stop, remove, create, start, wait-ready]
done:
  description: The actions actually done (empty in check mode).
  returned: always
  type: list
  elements: str
  sample: [create, start, wait-ready]
config_hash:
  description: The hash of the container settings (the C(meridian.node/config-hash) label); V(null) for O(state=absent).
  returned: always
  type: str
  sample: sha256:9b0c1f8e6f0e4d1b2a3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
drifted:
  description: The settings of the existing container that differ from those it would be created with now
    (changed by hand with C(docker update), or a container recreated by hand with this engine's labels);
    the plan replaces it, and the diff shows those settings before and after (for C(env) only the
    variables' names). Names among C(image), C(command), C(env), C(labels), C(ports), C(gpus), C(mounts),
    C(restart_policy), C(ipc_mode), C(shm_size), C(ulimits), C(init), C(stop), C(memory), C(cpus),
    C(blkio), C(pids_limit), C(privileged), C(capabilities), C(devices), C(network_mode), C(pid_mode),
    C(security_opt). Empty when nothing drifted.
  returned: always
  type: list
  elements: str
  sample: [restart_policy, memory]
container:
  description: The engine's container after the run; V(null) when there is none.
  returned: always
  type: dict
  contains:
    id:
      description: Container id.
      type: str
    name:
      description: Container name (the engine's name).
      type: str
    status:
      description: Docker state, such as C(running), C(created) or C(exited).
      type: str
ready:
  description: Whether the engine's readiness probe passed; V(null) when the engine does not run or in check mode.
  returned: always
  type: bool
probe:
  description: The last readiness probe's verdict, in words.
  returned: always
  type: str
  sample: GET /health answered 200
pending:
  description: In check mode only, when the engine's artifact is not in the store yet (a
    M(meridian.node.verified_artifact) task before it would make it present, but check mode did not run
    it), why the container settings and placement could not be checked. The planned actions assume the
    artifact arrives; outside check mode a missing artifact fails with C(check=artifact).
  returned: when the artifact is pending in check mode
  type: str
  sample: "artifact 'llama-3' has no promoted version in the store: ...; placement was not checked"
held:
  description: The cordon that holds the engine stopped - C(by) (where the cordon comes from), C(reason),
    C(gpus) (empty for a node cordon).
  returned: when a draining cordon holds the engine
  type: dict
image_pull:
  description: The pull of the engine's image - C(image), C(pulled), C(bytes) and C(seconds); in check mode
    C(would_pull), C(registry), C(size_bytes) (null - the Engine API tells only the manifest's size before a
    pull, in C(size_note)) and C(free_bytes); on a failed pull how far it got. Shown by C(ansible-playbook -v).
  returned: when the image had to be pulled (or would be, in check mode)
  type: dict
  sample: {image: "registry.local:5000/engines/vllm@sha256:9b0c...", pulled: true, bytes: 4194304, seconds: 1.52}
placement_warnings:
  description: What placement let through but says - a GPU whose health is C(degraded), or one of C(unhealthy)
    or C(unknown) health that only O(force) placed the engine on - with the GPU, its verdict and its reasons.
    Also in the run's warnings and in the diff's C(after).
  returned: when placement has something to say
  type: list
  elements: str
  sample: ["engine 'chat' goes on GPU '1' (GPU-...), whose health is degraded: retirement-pending True (...)"]
check:
  description: On failure, the check or step that failed (for example C(policy-image), C(placement-vram),
    C(placement-health), C(placement-cordoned), C(readiness)).
  returned: failed
  type: str
  sample: placement-port
diff:
  description: Running state, config hash and the spec, before and after - C(env) values whole, each
    O(secret_env) name beside V(<secret>) (a changed secret shows as a changed C(config_hash)); the drifted
    settings under C(settings) when RV(drifted) is not empty, and RV(placement_warnings) in C(after).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.engines.instance_args import (
    ARGUMENT_SPEC,
    REQUIRED_IF,
    engine_instance_outcome,
)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, required_if=REQUIRED_IF, supports_check_mode=True)
    run_module(module, engine_instance_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
