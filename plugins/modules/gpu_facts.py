#!/usr/bin/python
# Copyright: (c) 2026, meridian.node developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_facts
short_description: Gather NVIDIA GPU facts through NVML
version_added: 0.1.0
author:
  - Meridian node maintainers (@meridian)
description:
  - Reads every NVIDIA GPU on the host through NVML (the C(pynvml) module of nvidia-ml-py) and
    returns them as the C(meridian_gpus) fact, in the shape of the C(GpuFacts) contract
    (C(contracts/v1/gpu-facts.schema.json)).
  - Per GPU - index, UUID, name, PCI bus id, memory total/used/free (MiB), utilization, temperature,
    power draw and limit (W), volatile ECC error counts, MIG mode and MIG instances, compute processes
    and active NVLink peers. For the host - the driver and CUDA driver versions.
  - In the vocabulary of NVIDIA's GPU feature discovery (GFD) - per GPU the CUDA compute capability,
    architecture family, MIG capability, serial number, persistence mode, clocks and PCIe link; for the
    host the machine type (the DMI product name), the MIG strategy that fits what NVML shows, and the
    C(nvidia.com/*) node labels GFD would write.
  - Unless O(gather_health=false), a health verdict per GPU (C(healthy), C(degraded), C(unhealthy),
    C(unknown)) with its reasons and the readings it was judged from - retired pages, remapped rows, the
    driver's recovery action, PCIe replays, clock-event reasons, power and thermal violation time, NVLink
    errors and XID events. Any NVML error other than NOT_SUPPORTED on a health read counts against the GPU.
  - A host without NVML (no nvidia-ml-py, no NVIDIA driver, driver not loaded) is not an error - the
    fact says C(nvml_available=false) and gives the reason.
  - A value the GPU does not support is V(null). A GPU that fails while being read is still listed
    with what could be read, and its C(error) names the NVML error.
  - Never changes anything on the host.
requirements:
  - nvidia-ml-py (provides the C(pynvml) module) on the managed host.
  - An NVIDIA driver (C(libnvidia-ml.so.1)) to read any GPU.
options:
  gather_processes:
    description:
      - Read the compute processes of each GPU (or of each MIG instance when MIG is on).
      - Switch off to save one NVML call per GPU or MIG instance on large hosts.
    type: bool
    default: true
  gather_nvlink:
    description:
      - Read the state and remote PCI bus id of each NVLink.
      - Switch off to save up to two NVML calls per link on NVLink systems.
    type: bool
    default: true
  gather_health:
    description:
      - Read each GPU's health counters and XID events and judge them into a verdict (C(health)).
      - A single read cannot compare counters with an earlier one, so the rules about rising counters
        do not fire here, and it sees only the XIDs that happen while it reads; the agent, which reads
        every cycle, keeps both.
      - Switch off to save about ten NVML calls per GPU, plus four per active NVLink; C(health) is then
        V(null).
    type: bool
    default: true
extends_documentation_fragment:
  - meridian.node.attributes
  - meridian.node.attributes.no_diff
  - meridian.node.attributes.facts
notes:
  - With MIG enabled, NVML reports utilization only per MIG instance, so the GPU's utilization is
    V(null), and processes are read from the MIG instances.
  - NVLink peers on NVSwitch systems (HGX/DGX) are the NVSwitches' PCI bus ids.
  - The labels follow GFD's default configuration (no sharing, no timestamp); C(docs/GPU_FACTS.md) in the
    collection lists the labels GFD writes that this module does not, and why.
seealso:
  - name: NVML API reference
    description: The library this module reads.
    link: https://docs.nvidia.com/deploy/nvml-api/
"""

EXAMPLES = r"""
- name: Read the GPUs of every GPU host
  meridian.node.gpu_facts:

- name: Show free memory per GPU
  ansible.builtin.debug:
    msg: "{{ item.index }} {{ item.name }}: {{ item.memory.free_mib }} MiB free"
  loop: "{{ ansible_facts.meridian_gpus.gpus }}"
  when: ansible_facts.meridian_gpus.nvml_available

- name: Quick read on a large host, without processes, NVLink and health
  meridian.node.gpu_facts:
    gather_processes: false
    gather_nvlink: false
    gather_health: false

- name: Fail when a GPU is unhealthy
  ansible.builtin.assert:
    that: item.health.verdict != 'unhealthy'
    fail_msg: "GPU {{ item.index }} ({{ item.uuid }}): {{ item.health.reasons }}"
  loop: "{{ ansible_facts.meridian_gpus.gpus }}"
  when: ansible_facts.meridian_gpus.nvml_available
"""

RETURN = r"""
ansible_facts:
  description: Facts to add to the host's facts.
  returned: always
  type: dict
  contains:
    meridian_gpus:
      description: The GPUs of the host (the C(GpuFacts) contract).
      returned: always
      type: dict
      contains:
        nvml_available:
          description: Whether NVML could be used on this host.
          type: bool
          returned: always
          sample: true
        reason:
          description: Why NVML could not be used, and what to do about it; V(null) when it could.
          type: str
          returned: always
          sample: >-
            nvmlInit failed with NVML_ERROR_LIBRARY_NOT_FOUND (NVML Shared Library Not Found):
            libnvidia-ml.so.1 could not be loaded: no NVIDIA driver is installed on this host
        driver_version:
          description: The NVIDIA driver version.
          type: str
          returned: always
          sample: 550.54.15
        cuda_driver_version:
          description: The highest CUDA version the driver supports, as major.minor.
          type: str
          returned: always
          sample: "12.4"
        count:
          description: How many GPUs NVML sees.
          type: int
          returned: always
          sample: 8
        machine_type:
          description: The DMI product name, sanitised as GFD's C(nvidia.com/gpu.machine); V(null) where the
            host has no readable DMI (many VMs and containers).
          type: str
          returned: always
          sample: DGX-H100
        mig_strategy:
          description: The MIG strategy that fits what NVML shows - V(none) (no GPU in MIG mode), V(single)
            (every GPU in MIG mode with one profile throughout) or V(mixed); V(null) without NVML.
          type: str
          returned: always
          sample: none
        labels:
          description: The C(nvidia.com/*) node labels GPU feature discovery would write for this host;
            empty without NVML or GPUs.
          type: dict
          returned: always
          sample: {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
                   "nvidia.com/gpu.family": "hopper", "nvidia.com/mig.capable": "true"}
        gpus:
          description: One entry per GPU, in NVML index order.
          type: list
          elements: dict
          returned: always
          contains:
            index:
              description: NVML index of the GPU.
              type: int
              sample: 0
            uuid:
              description: GPU UUID.
              type: str
              sample: GPU-2f1b7c2e-8d3a-4c51-b0e6-1a9e4f7d3c01
            name:
              description: Product name.
              type: str
              sample: NVIDIA H100 80GB HBM3
            pci_bus_id:
              description: PCI bus id (domain:bus:device.function).
              type: str
              sample: 00000000:1B:00.0
            memory:
              description: Frame buffer memory in MiB, with keys C(total_mib), C(used_mib), C(free_mib).
              type: dict
              sample: {"total_mib": 81559, "used_mib": 74722, "free_mib": 6837}
            utilization_gpu_percent:
              description: GPU utilization over the last sample period; V(null) in MIG mode.
              type: int
            utilization_memory_percent:
              description: Memory controller utilization; V(null) in MIG mode.
              type: int
            temperature_c:
              description: GPU core temperature in degrees Celsius.
              type: int
            power_draw_w:
              description: Power draw in watts.
              type: float
            power_limit_w:
              description: Enforced power limit in watts.
              type: float
            ecc_errors_corrected:
              description: Volatile (since driver load) corrected ECC errors; V(null) without ECC.
              type: int
            ecc_errors_uncorrected:
              description: Volatile uncorrected ECC errors; V(null) without ECC.
              type: int
            mig_mode:
              description: Whether MIG is currently enabled; V(null) where the GPU has no MIG.
              type: bool
            mig_instances:
              description: MIG devices with C(uuid), C(profile), C(memory_mib), C(gpu_instance_id)
                and C(compute_instance_id).
              type: list
              elements: dict
            processes:
              description: Compute processes with C(pid) and C(used_memory_mib) (V(null) where NVML
                cannot tell).
              type: list
              elements: dict
            nvlink_peers:
              description: Active NVLinks with C(link) and C(peer_pci_bus_id).
              type: list
              elements: dict
            error:
              description: Why this GPU could not be read completely, naming the NVML error;
                V(null) when it could.
              type: str
              sample: NVML_ERROR_GPU_IS_LOST while reading memory info
            compute_capability:
              description: The CUDA compute capability, as major.minor.
              type: str
              sample: "9.0"
            architecture:
              description: The architecture family GFD derives from the compute capability (V(ampere),
                V(hopper), V(blackwell), ...).
              type: str
              sample: hopper
            mig_capable:
              description: Whether the GPU supports MIG (NVML answers its MIG mode).
              type: bool
            serial:
              description: The board serial number; V(null) where NVML does not report one (GeForce).
              type: str
            persistence_mode:
              description: Whether persistence mode is on.
              type: bool
            clocks:
              description: Current and maximum clocks in MHz, with keys C(graphics_mhz), C(sm_mhz),
                C(memory_mhz), C(max_graphics_mhz), C(max_sm_mhz), C(max_memory_mhz).
              type: dict
            pcie:
              description: The PCIe link as trained now and the most it can train to in this slot, with
                keys C(generation), C(width), C(max_generation), C(max_width).
              type: dict
              sample: {"generation": 5, "width": 16, "max_generation": 5, "max_width": 16}
            health:
              description: The verdict on this GPU's health, with C(verdict), C(reasons) (each
                C(code), C(source), C(value)), C(since), C(held) and the C(readings) it was judged from;
                V(null) with O(gather_health=false).
              type: dict
              sample: {"verdict": "unhealthy", "reasons": [{"code": "recovery-action",
                       "source": "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", "value": "reset"}]}
            cordoned:
              description: Whether this GPU is cordoned (no new engines). This module does not read
                cordons, so it reports V(false); the agent's observations carry the cordons in force.
              type: bool
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.meridian.node.plugins.module_utils._module import run_module
from ansible_collections.meridian.node.plugins.module_utils.gpu.facts_args import ARGUMENT_SPEC, gpu_facts_outcome


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run_module(module, gpu_facts_outcome(module.params, check_mode=module.check_mode))


if __name__ == "__main__":
    main()
