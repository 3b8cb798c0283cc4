"""Report builders, one module per figure, table or study.

Each module's ``build(df, out_dir, **options) -> list[Section]`` picks the runs it needs
from ``df`` (:func:`analysis.load.load_runs`; routing traces from their folders), writes
its figures (PNG + PDF) and files into ``out_dir`` and returns report sections
(:class:`analysis.sections.Section`). Its name is the module's: an experiment lists
builders in ``report`` (``report: fig3_lcc,table1_ct_runtime``) and their knobs in
``report_options`` (``{builder: {option: value}}``); :func:`analysis.sections.resolve_builders`
finds them.

Every number comes from measured rows, from a routing trace, or from the cost model
(column ``source = projected``, hatched or dashed in figures). The paper's own claims
(docs/paper_claims.md) are quoted as text beside them, never mixed into the data.
"""
