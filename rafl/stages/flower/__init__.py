"""rafl on Flower (``flwr`` 1.42, the Message API): the stages that hand
:class:`rafl.federation.flower_runner.FlowerClients` to the engine.

- :mod:`~rafl.stages.flower.app`: the Flower App (ServerApp + ClientApp) for a SuperLink;
- :mod:`~rafl.stages.flower.node`: the ClientApp's node side and its trust boundary;
- :mod:`~rafl.stages.flower.simulation`: Flower's Simulation Runtime (``engine.backend: flower``);
- :mod:`~rafl.stages.flower.fleet`: a SuperLink and SuperNodes on 127.0.0.1;
- :mod:`~rafl.stages.flower.superexec`: ``rafl flower-superexec``, the forking SuperExec;
- :mod:`~rafl.stages.flower.supernode`: ``rafl flower-supernode``, Flower's SuperNode with a shorter idle poll.
"""
