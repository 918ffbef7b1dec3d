"""The stages: what a command does, end to end, above the engine, the search and the supernet.

- :mod:`rafl.stages.checks`, :mod:`rafl.stages.data_checks`, :mod:`rafl.stages.profile_checks`: the
  checks the commands make before torch loads (no torch), which the work modules below call again;
- :mod:`rafl.stages.prepare`: a run config -> data, partition, supernet, searched subnets (or a
  model group) -> a federation and its engine config, every check before anything is written;
- :mod:`rafl.stages.runs`: a prepared federation run in its run dir with the client runner the
  caller picked (the engine, the run's reports, the summary);
- :mod:`rafl.stages.rundir`: :class:`~rafl.stages.rundir.RunDir`, the run dir's lifecycle;
- :mod:`rafl.stages.federate`: ``rafl federate`` (new run or ``--resume``; it picks the runner);
- :mod:`rafl.stages.compare`: ``rafl compare``, the methods on one partition;
- :mod:`rafl.stages.search`: ``rafl search``'s output folders;
- :mod:`rafl.stages.data`: ``rafl data``, a dataset's partition over the clients (after its checks);
- :mod:`rafl.stages.supernet`: ``rafl supernet train`` and ``rafl supernet info``;
- :mod:`rafl.stages.profile`: ``rafl profile``, a subnet's cost report or a measured latency LUT (after
  its checks);
- :mod:`rafl.stages.flower`: the Flower App, its node side, the Simulation Runtime, a local fleet,
  the forking SuperExec and the SuperNode with a shorter idle poll.
"""
