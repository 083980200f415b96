"""`servelm serve`: the command that chooses a deployment's topology and starts it.

    cli.py          the serve flags and the handler: one server (in-process engine or an
                    engine core process), or data-parallel / Ray / disaggregated replicas
                    behind the router
    config_file.py  `servelm serve --config FILE.yaml` and `servelm config show`
    topology.py     TopologyConfig: the topology options (replicas, disaggregation, where the
                    engine core runs, Ray), fields whose option() metadata makes their flags

Sits above both the HTTP server (server/) and the router (router/), since it starts either;
neither of them imports it (replicas get their options on stdin, not through an import).
Never: imports FastAPI or torch before the command runs (`servelm --help` stays fast).
"""
