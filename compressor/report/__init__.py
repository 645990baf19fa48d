"""Reports: grouping and atom-energy records, rich tables, `report.json` and PNG plots.

Everything here is a pure function of plain dicts (the report of `pipeline.compress_model`, the summary of
`api.compress`, the results of `inspection.inspect_statistics` / `preview.plan_from_config`), so the same
numbers go to the terminal, to JSON and to the pictures.
"""

from compressor.report.plots import (
    ALLOCATION_EXTRA_INCHES,
    ALLOCATION_ROW_INCHES,
    DPI,
    INSPECT_ENERGY_FIGSIZE,
    KL_PANEL_INCHES,
    MAP_EXTRA_INCHES,
    MAP_ROW_INCHES,
    RUN_FIGSIZE,
    plot_allocation,
    plot_energy,
    plot_grouping,
    plot_inspect_energy,
    plot_ranks,
)
from compressor.report.records import (
    ENERGY_CURVE_MAX_ATOMS,
    basis_label,
    energy_record,
    format_groups,
    group_label,
    kept_by_type,
    kept_fractions,
    pooled_energy,
    present_projections,
    write_json,
)
from compressor.report.run_report import write_run_report
from compressor.report.tables import (
    energy_table,
    groupings_table,
    input_bases_table,
    kl_table,
    plan_tables,
    stage_times_table,
    time_line,
)

__all__ = [
    "ALLOCATION_EXTRA_INCHES",
    "ALLOCATION_ROW_INCHES",
    "DPI",
    "ENERGY_CURVE_MAX_ATOMS",
    "basis_label",
    "INSPECT_ENERGY_FIGSIZE",
    "KL_PANEL_INCHES",
    "MAP_EXTRA_INCHES",
    "MAP_ROW_INCHES",
    "RUN_FIGSIZE",
    "energy_record",
    "energy_table",
    "format_groups",
    "group_label",
    "groupings_table",
    "input_bases_table",
    "kept_by_type",
    "kept_fractions",
    "kl_table",
    "plan_tables",
    "stage_times_table",
    "time_line",
    "plot_energy",
    "plot_allocation",
    "plot_grouping",
    "plot_inspect_energy",
    "plot_ranks",
    "pooled_energy",
    "present_projections",
    "write_json",
    "write_run_report",
]
