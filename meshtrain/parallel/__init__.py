"""Where the parallelisms meet: the parallel plan and the regions meshtrain writes by hand.

    layout.py           Layout.plan(config, sizes, platform): the pipeline plan, which axes each manual
                        region is manual over (accumulation, pipeline loop), whether Pallas kernels run
                        (regions then unchecked), the attention function, the data's token order; the
                        composition table of the regions is its docstring
    pipeline.py         the pipeline over `stage`: gpipe / circular tick scan, the stage function, the
                        residual stash, the `Pipeline` plan (ticks, table, in-flight, transfers)
    pipeline_tables.py  the slot-table executor: 1F1B, interleaved 1F1B and zero bubble in one SPMD loop
    slot_program.py     a slot table as the executor's static program (branches, buffer slots, transfers)
    schedules.py        the schedule registry and its slot tables: simulate, alternating, check, bubble,
                        in-flight micro-batches
    ring_attention.py   context parallelism over `sequence`: the ring (zig-zag, custom backward) and the
                        attention function the model calls
    ulysses.py          context parallelism by all-to-all (Ulysses), and a ring across its groups
    cost.py             the pipeline step as the lock-step loop executes it, priced from compiled branches

Everything else is left to XLA's partitioner through the logical-axis rules (`sharding_rules.py`).
The model imports nothing from here: it receives its attention function and its layer-stack runner
(`model.LayerStack`) from `Layout`, through `train_step.build`. The MoE exchange over `expert` stays
beside its layer (`moe.expert_parallel`) and opens its region over the batch axes its enclosing
region left automatic.
"""
