"""The worker side of elasticity: training steps that commit only when every member agrees, and
in-place recovery when the membership changes.

- `driver`      `ElasticDriver`: a worker's transactional steps (its docstring gives the whole
                protocol: report, agree, replan, regroup, transfer, go on).
- `state`       `DriverState`: the driver's state, one typed object; the modules below are
                functions of it.
- `rounds`      the named phases of one recovery, and the retry rounds; `standing`: what each
                rank says in a recovery's reconcile exchange.
- `planned`     changes at a step boundary that are not failures: drains, stragglers.
- `join`        a spare, or a node back after a worker crashed, joining a running generation.
- `generation`  this rank's groups in a generation, and a newer round noticed at once.
- `rendezvous`  a generation's store and process groups; `store`: the authenticated rendezvous
                store (torch's `Store` interface).
- `transfer`    lost layers' state copied from surviving replicas, in place.
- `straggler`   a node persistently slower than its profile, re-planned around (pure).

May import: `engine`, `planning`, `checkpoint`, `control` (the client and the membership types),
`records`, torch. The engine never imports this package: it reports failures as values, and the
driver handles them.
"""
