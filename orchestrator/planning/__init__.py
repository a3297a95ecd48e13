"""Planning a job before it runs: how many spares, how often to checkpoint, what will train.

A discrete-event simulator (:mod:`.simulator`) runs a job through weeks of
failures drawn from a failure model (:mod:`.presets`, or a job's own records:
:mod:`.from_run`) under each recovery tier, with recovery costs measured by
ringmaster's benchmarks (:mod:`.costs`); :mod:`.recommend` sweeps spares and
checkpoint cadence; :mod:`.report` writes the plan as text, PNG and HTML.
Contracts are in :mod:`.api`.  Pure Python: no torch, no etcd unless reading a run.
"""
