"""``python -m meridian_node_agent.devserver.cli``: the same as the ``meridian-node-devserver`` script."""

import sys

from meridian_node_agent.devserver.cli import main

sys.exit(main())
