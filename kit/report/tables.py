"""Tables for people: polars' display settings that notebooks turn on in their first cell.

polars' defaults are made for a terminal: columns elided as "…", text cells wrapped
mid-word to fit 100 characters, a dtype row and six-decimal floats. A notebook's reader
wants every column, whole words and two decimals.
"""

from __future__ import annotations

SETTINGS = {
    "tbl_rows": 40, "tbl_cols": -1, "tbl_width_chars": 160, "fmt_str_lengths": 80,
    "float_precision": 2, "tbl_hide_column_data_types": True, "tbl_hide_dataframe_shape": True,
}  # fmt: skip


def readable() -> None:
    """Set polars to show frames the way SETTINGS says, for the rest of the session.

    Example:
        >>> readable()
        >>> print(pl.DataFrame({"state": ["budget_reached"], "mean": [404.8125]}))
        ┌────────────────┬────────┐
        │ state          ┆ mean   │
        ╞════════════════╪════════╡
        │ budget_reached ┆ 404.81 │
        └────────────────┴────────┘
        >>> pl.Config.restore_defaults()  # doctest: +ELLIPSIS
        <class 'polars.config.Config'>
    """
    import polars as pl

    pl.Config(**SETTINGS)
