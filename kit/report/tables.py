"""Tables for people: polars' display settings that notebooks turn on in their first cell.

polars' defaults are made for a terminal: columns elided as "…", text cells wrapped
mid-word to fit 100 characters, a dtype row and six-decimal floats. A notebook's reader
wants every column, whole words and two decimals.
"""

from __future__ import annotations

_SETTINGS = {
    "tbl_rows": 40,
    "tbl_cols": -1,
    "tbl_width_chars": 160,
    "fmt_str_lengths": 80,
    "float_precision": 2,
    "tbl_hide_column_data_types": True,
    "tbl_hide_dataframe_shape": True,
}


def readable() -> None:
    """Set polars to show frames the way _SETTINGS says, for the rest of the session.

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

    pl.Config(**_SETTINGS)


def html(frame) -> str:
    """A frame of text as an HTML table for a notebook: each cell as written (polars' own
    HTML quotes every string), the first column left, the others right-aligned.

    Example:
        >>> html(pl.DataFrame({"dataset": ["essays"], "budget": ["5,000"]}))[-60:]
        '<td style="text-align:right">5,000</td></tr></tbody></table>'
    """
    from html import escape

    side = ["left"] + ["right"] * (len(frame.columns) - 1)

    def cells(tag: str, values) -> str:
        return "".join(
            f'<{tag} style="text-align:{s}">{escape("" if v is None else str(v))}</{tag}>'
            for s, v in zip(side, values, strict=True)
        )

    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in frame.iter_rows())
    return (
        f"<table><thead><tr>{cells('th', frame.columns)}</tr></thead><tbody>{body}</tbody></table>"
    )
