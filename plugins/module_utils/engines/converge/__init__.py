"""The phases of one engine's converge, each written once.

``engines.instance`` puts them in order for one engine, ``engines.set`` for a set; this package imports
neither. In the order a converge meets them:

- ``engine_run``: what a converge is told (``Options``, ``RunOptions``) and knows as it goes (``EngineRun``);
- ``prepare``: the spec, policy, volumes, driver settings, Docker's view of the engine and its plan;
- ``gates``: a cordon that holds the engine, placement (GPUs, VRAM, port, runtime) and the image's labels;
- ``room``: room beside the old container for a replace that keeps the engine serving;
- ``images``: the images Docker lacks, pulled before anything is drained, and root's record of them;
- ``act``: the plan's actions in order, a failed replace rolled back;
- ``waits``: the drain, the readiness waits and their poll intervals.
"""
