"""The wire format of a trace, and the typed records every other module reads instead of it.

This package is the one place that knows the on-disk keys of a trace: the short msgpack keys of an op record and a
tensor reference (``keys``), and the manifest's. The recorder builds records through the ``wire_*`` functions;
readers get ``OpRecord`` and ``TensorRef``: slotted views over the decoded dict, so reading a field costs a dict
lookup and nothing is converted that is not asked for. One module per area:

- ``keys``: the op record and tensor reference keys;
- ``values``: values inside records (TensorRef, Opaque, TensorStats) and their codec;
- ``ops``: the typed op record (OpRecord) and what it carries (collective, random state, written arguments);
- ``units``: compiled units, their graph stored as data;
- ``index_rows``: an op's index row, and checking a chunk read back;
- ``op_wire``: building op records and tensor references (the recorder's side);
- ``plant``: the planted fault's manifest entry (PlantedFaultInfo);
- ``environment``: the environment snapshot (Environment, EnvFlags, Device);
- ``manifest``: record options, compiled regions, flight dump, command line, writer totals;
- ``left_out``: what a recording left out, per op and per rank.

Every public name is re-exported here, so ``from replaydiff.trace import schema`` and ``schema.OpRecord`` keep
working.
"""
from replaydiff.trace.schema.values import (Opaque, TensorRef, TensorStats, decode_value, dtype_from_name, encode_value,
                                            iter_refs, value_json)
from replaydiff.trace.schema.ops import (ArgPath, CollectiveInfo, MODULE_GRAD, MODULE_OUTPUT, MODULE_PARAM, OpRecord,
                                         PHASES, RngState, StoredBytes, wire_collective)
from replaydiff.trace.schema.units import (NODE_CALL, NODE_CONST, NODE_INPUT, NODE_OUTPUT, NodeRef, UnitInfo, UnitNode,
                                           encode_graph_value, wire_node, wire_set_unit)
from replaydiff.trace.schema.index_rows import IndexRow, check_chunk, chunk_frame, index_row
from replaydiff.trace.schema.op_wire import (ENTERED_REASON, check_entered, wire_entered, wire_index,
                                             wire_is_collective, wire_left_out, wire_nonfinite, wire_nonfinite_inputs,
                                             wire_not_recorded, wire_ref_nonfinite,
                                             wire_op, wire_rechunk, wire_set_chunk, wire_set_collective,
                                             wire_set_inputs, wire_set_left_out, wire_set_outputs, wire_set_rng,
                                             wire_set_recompute, wire_set_stats, wire_set_step, wire_stats_key,
                                             wire_stored_tensor,
                                             wire_strip_chunks, wire_tensor, wire_unsupported, wire_zero)
from replaydiff.trace.schema.plant import PlantedFaultInfo, plant_from_wire, wire_plant
from replaydiff.trace.schema.environment import (Device, EnvFlags, Environment, env_key, flatten_keys, wire_device,
                                                 wire_environment)
from replaydiff.trace.schema.manifest import (CompiledRegion, FlightDump, OpsFileWritten, RecordedOptions,
                                              compiled_regions_from_wire, manifest_bytes_written, manifest_command,
                                              manifest_flight, manifest_last_op, manifest_metadata, manifest_ops_files,
                                              manifest_stopped, wire_closing_facts, wire_flight, wire_manifest,
                                              wire_options, wire_writer_totals)
from replaydiff.trace.schema.left_out import (LEFT_OUT_BUDGET, LEFT_OUT_DEVICE_PENDING, LEFT_OUT_DISK_FULL,
                                              LEFT_OUT_FILTERED, LEFT_OUT_UNWANTED, LEFT_OUT_WHY, LeftOut, LeftOutTally,
                                              left_out_from_manifest)
