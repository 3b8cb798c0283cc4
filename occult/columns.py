"""Settings that are columns of every results row, and config keys added after results were
first written: both declared on the schema field itself.

* :func:`column`: a setting that selects behaviour (``task.microbatches``,
  ``system.dispatch_mode``, ...). The recorder writes it as a column of every row, named
  by the field (:func:`setting_values`, :func:`own_settings`); a run whose task or system
  has no such field writes the column's ``absent`` value, declared with the field, once.
  A figure reads the column, never a metric row or the ``system_options`` JSON.
* ``later=``, on :func:`column` or :func:`later`: the field was added after results were
  first written, and configs that hold this value hash as the configs without the key did
  (so earlier runs keep their hash and resume: :func:`occult.runner.run_hashed_config`).

This module only declares and reads declarations (it sits below every schema); which schemas
there are is :func:`occult.config.schemas`'s to say (the cluster's, the model's, every system's
and every task's), and :func:`occult.config.later_keys` and
:func:`occult.config.setting_columns` apply the functions below to them.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator

COLUMN = "occult.column"        # field metadata: the value a run without the field writes
LATER = "occult.later"          # field metadata: the value configs held before the key existed
_SAME = object()                # "the field's default"


def _field(default, metadata: dict) -> dataclasses.Field:
    if isinstance(default, (list, dict)):       # a mutable default: a fresh copy per instance
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def column(default, *, absent: Any = _SAME, later: Any = _SAME) -> Any:
    """A schema field that is a column of every row: ``absent`` is what a run whose task or
    system lacks the field writes (default: ``default``); ``later``: the value configs held
    before the field existed (left out: the field is as old as the results)."""
    metadata = {COLUMN: default if absent is _SAME else absent}
    if later is not _SAME:
        metadata[LATER] = later
    return _field(default, metadata)


def later(default, *, held: Any = _SAME) -> Any:
    """A schema field added after results were first written: configs holding ``held``
    (default: ``default``) hash as the configs without the key did."""
    return _field(default, {LATER: default if held is _SAME else held})


def _marked(schemas: dict, key: str) -> Iterator[tuple]:
    """``(group, field)`` of every field of ``schemas`` (``{group: [dataclass, ...]}``)
    whose metadata holds ``key``."""
    for group, classes in schemas.items():
        for cls in classes:
            for f in dataclasses.fields(cls):
                if key in f.metadata:
                    yield group, f


def _collect(pairs: Iterator[tuple], what: str) -> dict:
    """``{name: value}`` from ``(name, value)`` pairs; one name declared with two values is
    an error (a value is declared once)."""
    out: dict = {}
    for name, value in pairs:
        if name in out and out[name] != value:
            raise ValueError(f"{name}: declared with two {what} values, {out[name]!r} and {value!r}")
        out[name] = value
    return out


def later_keys_of(schemas: dict) -> dict:
    """``{"<group>.<field>": value}`` of the ``later`` fields of ``schemas``."""
    return _collect(((f"{g}.{f.name}", f.metadata[LATER]) for g, f in _marked(schemas, LATER)), "later")


def columns_of(schemas: dict) -> dict:
    """``{field name: (group, absent value)}`` of the column fields of ``schemas``, sorted by
    name (a column is named by its field: one name in two groups is an error)."""
    found = _collect(((f.name, (g, f.metadata[COLUMN])) for g, f in _marked(schemas, COLUMN)), "group and absent")
    return dict(sorted(found.items()))


def own_settings(config) -> dict:
    """``{column: value}`` of the column fields a typed config declares: what a compared
    system's rows carry of their own (their other settings are the run's,
    :func:`occult.records.make_frame`; a task that compares systems runs no system of its
    own, so the run's system columns hold their ``absent`` values)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if COLUMN in f.metadata}


def _value(config, name: str, absent):
    """``config``'s ``name`` (a typed config, a DictConfig or a dict), ``absent`` without one."""
    if config is None:
        return absent
    if dataclasses.is_dataclass(config):
        return getattr(config, name) if name in {f.name for f in dataclasses.fields(config)} else absent
    return config[name] if name in config else absent


def setting_values(configs: dict, columns: dict) -> dict:
    """The setting columns of one run: ``configs`` is ``{group: typed config}`` (None for a
    group the run lacks, e.g. a task that runs no system), ``columns`` the columns
    (:func:`columns_of`); each column of those groups holds the config's value, or its
    ``absent`` value where the config has no such field."""
    lacking = sorted({group for group, _ in columns.values()} - set(configs))
    if lacking:
        raise ValueError(f"setting_values: columns declared in the groups {lacking}, which the run's configs lack")
    return {name: _value(configs[group], name, absent) for name, (group, absent) in columns.items()}
