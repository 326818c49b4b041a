"""Fixtures every end-to-end module uses: one devserver and one tagged stand-in image per module, a
container name prefix, a node id and a node per test (containers with the prefix are removed afterwards); see
tests/support/devserver_fixtures.py and tests/support/e2e_fixtures.py. The real llama.cpp engine's image and
its random-weight GGUF models, once per session: tests/support/llamacpp_image.py and gguf_models.py."""

from ansible_collections.meridian.node.tests.support.devserver_fixtures import (  # noqa: F401
    node_id,
    server,
)
from ansible_collections.meridian.node.tests.support.e2e_fixtures import image, node, prefix  # noqa: F401
from ansible_collections.meridian.node.tests.support.gguf_models import slow_gguf, tiny_gguf  # noqa: F401
from ansible_collections.meridian.node.tests.support.llamacpp_image import llamacpp_image  # noqa: F401
