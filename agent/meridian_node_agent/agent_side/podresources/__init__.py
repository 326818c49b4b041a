"""The kubelet's PodResources API: its definition (api.proto), the stubs made from it, and the client."""
