#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: engine_set
short_description: Converge a host's whole set of inference engines in one task
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Converges every engine of a host at once, each exactly as M(meridian.node.engine_instance) would converge
    it alone (the same checks, the same container settings and config hash, the same drain before a replacement),
    and optionally prunes the engines of O(owner) the set no longer lists.
  - The engines come from O(engines), or from a signed desired state (O(envelope) and O(node_id)) that this
    module verifies itself against the host policy and the durable applied state, as
    M(meridian.node.desired_state) does. In that form the engines' C(secret_env) values never pass through
    task arguments, registered variables or the run's journal.
  - The whole set is planned before anything changes, read-only - every spec, the policy, ownership, and for
    every engine to be created the image, the GPUs (not cordoned, and not of C(unhealthy) or C(unknown) health
    unless the engine says O(engines[].force) - see C(docs/GPU_HEALTH.md)), the VRAM and the port, with the
    set's own reservations (two new engines on one GPU must fit together; the VRAM and port of an engine being
    pruned or replaced are credited). Any refusal fails the module before any change, naming the engine and the
    check. What placement lets through but must say (a C(degraded) GPU, O(engines[].force) on a bad one) is in
    the module's warnings, each engine's C(placement_warnings) and the diff.
  - Then every image an engine is to be created from and the local Docker Engine lacks is pulled, each once, by
    its digest (never a tag) from a repository the policy allows, with the credentials of the policy's
    C(images.registry_auth_file), and verified, before any engine is drained, held or stopped - a failed,
    stalled (C(images.pull_stall_seconds), check C(image-pull-stalled)) or refused (C(images.min_free_bytes),
    check C(disk-low)) pull fails the module with every engine serving as before. Check mode pulls nothing and
    reports each pull it would make.
  - Then, in order - the pruned engines that hold a port or a GPU a listed engine needs are drained and removed;
    the listed engines converge, up to O(parallel) at once (created and started together, waited for together,
    each replaced engine drained first under its own drain timeout); then the other pruned engines are drained
    and removed, once the listed ones serve.
  - One engine failing does not stop the others already under way; the result reports every engine, and the
    module fails naming each failed engine with its check. An engine that does not get ready is stopped, as
    M(meridian.node.engine_instance) does.
  - Only containers with meridian.node's ownership labels are touched, and only those of O(owner) are pruned.
    A container with a listed engine's name but without our labels fails the module before any change.
requirements:
  - PyYAML on the managed host, and a Docker Engine (API 1.41 or newer) reached through its socket or
    E(DOCKER_HOST); no other Python package is needed for O(engines).
  - pydantic and cryptography on the managed host for O(envelope).
  - nvidia-ml-py on hosts whose engines ask for GPUs.
options:
  engines:
    description:
      - The engines, each with the options of M(meridian.node.engine_instance) for one engine, and the same
        defaults. Mutually exclusive with O(envelope).
    type: list
    elements: dict
    suboptions:
      name:
        description:
          - The engine's name, also its container's name.
        type: str
        required: true
      state:
        description:
          - V(started), V(present), V(stopped) or V(absent), as O(meridian.node.engine_instance#module:state).
        type: str
        choices: [present, started, stopped, absent]
        default: started
      driver:
        description:
          - The engine. Required unless O(engines[].state=absent).
        type: str
        choices: [vllm, tgi, sglang, ollama, llamacpp, lmdeploy, openai]
      image:
        description:
          - The engine image, C(repository[:tag]@sha256:<digest>), local and allowed by the policy. Required
            unless O(engines[].state=absent).
        type: str
      model:
        description:
          - Exactly one of O(engines[].model.artifact) or O(engines[].model.name). Required unless
            O(engines[].state=absent).
        type: dict
        suboptions:
          artifact:
            description:
              - A model artifact promoted in the local store; mounted read-only.
            type: str
          name:
            description:
              - A model name, for engines that fetch and manage their own models.
            type: str
      served_model_name:
        description:
          - The model name clients use.
        type: str
      gpus:
        description:
          - GPUs by uuid or index, or MIG instances by uuid.
        type: list
        elements: str
        default: []
      min_vram_mib:
        description:
          - Free VRAM, in MiB, each requested device must have for this engine after the other engines'
            reservations, those of this set included.
        type: int
        default: 0
      force:
        description:
          - Place the engine on GPUs whose health verdict is C(unhealthy) or C(unknown), which placement
            otherwise refuses (C(check=placement-health)); the run warns, naming each such GPU and its reasons.
            A cordoned GPU is refused whatever this says. Changing it alone replaces nothing.
        type: bool
        default: false
      port:
        description:
          - The host port, on the policy's bind address. Required unless O(engines[].state=absent).
        type: int
      args:
        description:
          - Extra engine arguments.
        type: list
        elements: str
        default: []
      env:
        description:
          - Environment variables, shown whole in the diff and the result.
        type: dict
        default: {}
      secret_env:
        description:
          - Environment variables whose values only the container sees, as
            O(meridian.node.engine_instance#module:secret_env) - C(no_log); the diff and results show the names
            beside V(<secret>) and a changed value as a changed config hash. A name may not also be in O(engines[].env).
        type: dict
        default: {}
      restart_policy:
        description:
          - As O(meridian.node.engine_instance#module:restart_policy).
        type: str
        choices: ["no", on-failure, unless-stopped]
        default: unless-stopped
      shm_size_mib:
        description:
          - The size of C(/dev/shm) in MiB; the driver's default when not given.
        type: int
      ipc_mode:
        description:
          - V(private), or V(host) where the policy allows it.
        type: str
        choices: [private, host]
        default: private
      ulimits:
        description:
          - Resource limits by name, as O(meridian.node.engine_instance#module:ulimits).
        type: dict
        default: {}
      volumes:
        description:
          - Host paths mounted read-only, as O(meridian.node.engine_instance#module:volumes).
        type: list
        elements: dict
        default: []
        suboptions:
          source:
            description:
              - The host path.
            type: str
            required: true
          target:
            description:
              - The path inside the container.
            type: str
            required: true
      labels:
        description:
          - The engine container's own labels.
        type: dict
        default: {}
      health_path:
        description:
          - The readiness path of a generic O(engines[].driver=openai) server.
        type: str
      replace_strategy:
        description:
          - V(drain-then-replace) or V(stop-then-start), as O(meridian.node.engine_instance#module:replace_strategy).
        type: str
        choices: [drain-then-replace, stop-then-start]
        default: drain-then-replace
      ready_timeout:
        description:
          - Seconds this engine gets to become ready; defaults to O(ready_timeout).
        type: int
      drain_timeout:
        description:
          - Seconds this engine's requests get to finish before it is replaced; defaults to O(drain_timeout).
        type: int
      drain_grace:
        description:
          - Seconds to wait when draining this engine if it publishes no in-flight metrics; defaults to
            O(drain_grace).
        type: int
  envelope:
    description:
      - Path to a desired-state DSSE envelope, byte for byte as signed; the engines are its engines, C(secret_env)
        values included. Verified here as M(meridian.node.desired_state) verifies it. Needs O(node_id).
      - Every artifact the state lists must already be in the store as its signed manifest says - recorded with the
        manifest's files, intact, and the promoted version (M(meridian.node.verified_artifact) makes it so);
        otherwise the module fails before any change, naming the artifact. In check mode that is a warning.
    type: path
  node_id:
    description:
      - This node's id, for O(envelope); a state for any other node is refused.
    type: str
  record:
    description:
      - Only with O(envelope). Record the state's generation as applied once every engine converged; a failure
        records nothing. An already-applied generation still converges (repairs drift) and reports
        RV(recorded=false).
      - The verification at the start of the run decides; the record refuses only a generation below the one
        recorded meanwhile, or the same generation with other bytes.
    type: bool
    default: false
  owner:
    description:
      - Recorded in every engine's C(meridian.node/owner) label, and whose engines O(prune) removes. Required
        with O(prune); with O(envelope) it defaults to C(agent:<node_id>).
    type: str
  prune:
    description:
      - Drain and remove the engines of O(owner) that the set does not list. Never a container of another owner
        or without meridian.node's labels.
      - Then, once every listed engine converged, remove the images O(owner)'s runs pulled (and, with
        O(envelope), images loaded from air-gap bundles) that no listed engine names and no container uses,
        C(images.prune_grace_seconds) of the policy (default one day) after a prune first found them unused.
        An image with any tag or repository digest this project did not give it is kept. See C(docs/SECURITY.md),
        "Pruning engine images".
      - Defaults to V(false) with O(engines) and V(true) with O(envelope).
    type: bool
  parallel:
    description:
      - How many engines are acted on at once.
    type: int
    default: 8
  cordon:
    description:
      - A cordon for this run, read together with the host's (M(meridian.node.cordon)) and the policy's. With
        O(envelope) the signed state's own C(cordon) is used instead, so this option is not allowed there.
      - Engines on cordoned GPUs (all engines, for a node cordon) are not created; with O(cordon.drain=true)
        those to be started are drained, stopped and held stopped instead. An engine no cordon holds any more
        is started and its cordon's draining mark cleared.
    type: dict
    suboptions:
      gpus:
        description:
          - GPUs by uuid, index or MIG uuid; empty - the whole node.
        type: list
        elements: str
        default: []
      drain:
        description:
          - Drain, stop and hold the engines the cordon covers.
        type: bool
        default: false
      reason:
        description:
          - Why, in the held engines' draining marks and results.
        type: str
  ready_timeout:
    description:
      - Seconds an engine gets to become ready, for the engines that set none.
    type: int
    default: 600
  drain_timeout:
    description:
      - Seconds a replaced or pruned engine's requests get to finish, for the engines that set none.
    type: int
    default: 300
  drain_grace:
    description:
      - Seconds to wait when draining an engine that publishes no in-flight metrics, for the engines that set none.
    type: int
    default: 10
  store_path:
    description:
      - The artifact store to resolve models in. Defaults to the policy's C(store.path).
    type: path
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.diff
  - meridian.node.host
  - meridian.node.engine
  - meridian.node.attributes.action
notes:
  - Each engine's result is the one M(meridian.node.engine_instance) returns for it.
seealso:
  - module: meridian.node.engine_instance
  - module: meridian.node.desired_state
"""

EXAMPLES = r"""
- name: Run one vLLM engine per GPU
  meridian.node.engine_set:
    engines:
      - name: llama-0
        driver: vllm
        image: registry.example.com/vllm@sha256:4f5c0a6a0e0e7f1d2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
        model:
          artifact: llama-3-8b-instruct
        gpus: ["0"]
        min_vram_mib: 20000
        port: 8001
      - name: llama-1
        driver: vllm
        image: registry.example.com/vllm@sha256:4f5c0a6a0e0e7f1d2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
        model:
          artifact: llama-3-8b-instruct
        gpus: ["1"]
        min_vram_mib: 20000
        port: 8002
    owner: ops
    prune: true

- name: Converge the engines of a signed desired state and record it as applied
  meridian.node.engine_set:
    envelope: /var/lib/meridian-node-apply/spool/desired-state.json
    node_id: gpu-node-1
    record: true
"""

RETURN = r"""
engines:
  description: Per engine name, the result M(meridian.node.engine_instance) returns for it - C(actions), C(done),
    C(config_hash), C(container), C(drifted), C(ready), C(probe), C(diff), C(placement_warnings) when
    placement has something to say, C(image_pull) when its image was pulled (or would be, in check mode - every
    missing image is pulled before any engine is drained or stopped, so a failed or stalled pull leaves them
    all serving), C(held) (by, reason, gpus) for an engine a draining cordon holds stopped,
    and on failure C(failed), C(msg) and C(check). C(env) values are shown whole; C(secret_env) values never
    appear (the diff shows each name beside V(<secret>)).
  returned: always
  type: dict
  sample:
    llama-0:
      actions: []
      done: []
      config_hash: sha256:9b0c1f8e6f0e4d1b2a3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192
      container: {id: 3f1c2b, name: llama-0, status: running}
      drifted: []
      ready: true
      probe: GET /health answered 200
pruned:
  description: The engines of O(owner) removed (in check mode, to be removed) because the set does not list
    them, in the order they go; C(reason) V(first) for those in a listed engine's way, V(later) for the others.
  returned: always
  type: list
  elements: dict
  sample: [{name: old-llama, reason: first}]
images:
  description: With O(prune), the images removed (in check mode, that a real run would remove now) and those
    waiting out their grace (C(seconds_left)), each by C(reference) and C(image_id).
  returned: with O(prune)
  type: dict
  sample:
    removed: [{image_id: "sha256:5d2e...", reference: "registry.example/vllm@sha256:9f1c..."}]
    waiting: [{image_id: "sha256:77ab...", reference: "registry.example/vllm@sha256:0b3e...", seconds_left: 3541.2}]
generation:
  description: The desired state's generation.
  returned: with O(envelope)
  type: int
  sample: 7
recorded:
  description: Whether this run recorded the generation as applied.
  returned: with O(envelope)
  type: bool
check:
  description: On failure before any change, the check that refused (for example C(policy-image),
    C(ownership), C(placement-vram), C(placement-health), C(placement-cordoned)); when engines failed while
    converging, C(engines); when the engines converged but the image prune failed, C(image-prune).
  returned: failed
  type: str
rejection:
  description: The rejection code when the envelope was refused (for example V(expired), V(replayed)).
  returned: failure by rejection
  type: str
diff:
  description: Per engine, its diff before and after (as M(meridian.node.engine_instance)'s).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.engines.set_args import (
    ARGUMENT_SPEC,
    MUTUALLY_EXCLUSIVE,
    REQUIRED_ONE_OF,
    REQUIRED_TOGETHER,
    engine_set_outcome,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        mutually_exclusive=MUTUALLY_EXCLUSIVE,
        required_one_of=REQUIRED_ONE_OF,
        required_together=REQUIRED_TOGETHER,
        supports_check_mode=True,
    )
    run_module(module, engine_set_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
