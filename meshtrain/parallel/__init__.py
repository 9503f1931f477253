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

Glossary of the pipeline files (docs/architecture.md walks through one table):

    stage           a device group along `stage` and the layers it holds (p stages)
    chunk           one of the v = `pipeline.repeats` blocks of layers a stage holds (interleaved and
                    circular: chunk c of stage s is virtual stage c*p + s); 1 elsewhere
    micro-batch     one of the m = `pipeline.microbatches` slices of a step's batch
    F, B, W         an operation on one (micro-batch, chunk): the forward; the backward (with W inside
                    it, except under the split backward, where B is the input gradient only); the weight
                    gradient (`schedules.Op`)
    part            W cut into `weight_parts` operations, each over 1/weight_parts of the chunk's layers
    span            the micro-batches one W covers where W's run in their B's round (`aligned`); also
                    `weight_span` (the config key asking for it) and `w_span` (the span a run gets)
    table           tick -> the operation of every stage (`schedules.executed`), one per schedule
    tick            one row of the table: every stage runs its operation (or idles), then transfers
    in flight       micro-batch chunks whose activations a stage holds, from their F to their B (or W)
    program         the table as integers (`slot_program.SlotPlan.program`): per tick and stage the
                    branch of the tick's `lax.switch`, the micro-batch, the chunk and the slots used
    slot            an index into a statically sized buffer: the stash (residuals, F to B), the weight
                    slots (what W reads, B to W), the inboxes (arriving activations and gradients); an
                    inbox index equal to its size is the trash slot (nothing arrives)
    record          what W reads of one (micro-batch, chunk) under the split backward: the matmuls'
                    inputs and output gradients (`SlotUnion`: one buffer a chunk holds from F to W)
    handoff         B's records given straight to the W ticks of the same loop step, carried in no slot
    segment         a range of ticks run as one `lax.scan` whose switch has the same branches
                    (`SlotPlan.segments`); a loop step of it runs one or two ticks (parity 0, 1)
    latency         ticks a transfer spends beyond the next (1: `pipeline.overlap_transfers`)
    bubble          idle over busy time of a stage (the playbook's t_bubble / t_ideal)

Everything else is left to XLA's partitioner through the logical-axis rules (`sharding_rules.py`).
The model imports nothing from here: it receives its attention function and its layer-stack runner
(`model.LayerStack`) from `Layout`, through `train_step.build`. The MoE exchange over `expert` stays
beside its layer (`moe.expert_parallel`) and opens its region over the batch axes its enclosing
region left automatic.
"""
