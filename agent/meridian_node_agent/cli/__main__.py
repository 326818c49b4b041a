"""``python -m meridian_node_agent.cli``: the same as the ``meridian-node`` script."""

import sys

from meridian_node_agent.cli import main

sys.exit(main())
