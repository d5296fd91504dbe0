"""Locker's display extensions for the Python (ipykernel) code interpreter.

Locker's code driver runs this file once, as a silent execute_request, in
every new IPython kernel before any user code.  It is Locker's own
implementation of the extra result formats that E2B's code-interpreter SDKs
read; it shares no code with E2B's startup scripts or its chart extractor.

What it adds:

* ``e2b/data`` -- when a pandas DataFrame is displayed (or is a cell's last
  value), a dict of column name -> list of values.  Every value is made
  JSON-safe: timestamps and dates become ISO-8601 strings, NaN / NaT / NA
  become None, numpy scalars become plain Python numbers.  The SDKs expose
  it as ``result.data``.
* ``e2b/chart`` -- when a matplotlib Figure is displayed (``plt.show()`` with
  the inline backend displays the figure; a Figure as the last value does
  too), a dict in E2B's chart schema (types line, scatter, bar, pie,
  box_and_whisker, superchart and unknown), which the SDKs parse into
  ``result.chart``.
* PIL hooks -- ``Image.save(path, ...)`` with a path also displays the
  image (so it arrives as a PNG result), and ``Image.show()`` displays the
  image inline instead of trying to start an image viewer (a sandbox has
  no display).

What it must not do:

* Import pandas, matplotlib or PIL itself.  The formatters look at
  ``sys.modules`` and do nothing until user code has imported the library;
  the PIL hooks wait in a tiny import hook until ``PIL.Image`` /
  ``PIL.ImageShow`` is imported.
* Break a cell.  Any failure inside a formatter means "no value for this
  MIME type"; nothing is printed and no traceback is shown.
* Leave names behind.  Everything lives inside one ``__locker_``-prefixed
  function, which is deleted from the user's namespace at the end, so
  ``globals()`` looks exactly as it did before.
* Change results of anything else: ``1 + 1`` still yields only text/plain.

Written for (and tested on) Debian bookworm's python3-ipykernel 6.17,
IPython 8.5, matplotlib 3.6, pandas 1.5 and pillow 9.4; it only uses APIs
that newer releases keep, and falls back quietly where a private attribute
is missing.
"""


def __locker_display_setup():
    import base64
    import datetime
    import decimal
    import functools
    import io
    import math
    import numbers
    import os
    import re
    import sys
    import warnings

    try:
        from IPython import get_ipython
        from IPython.core.formatters import BaseFormatter
        from traitlets import ObjectName, Unicode
    except Exception:
        return
    shell = get_ipython()
    if shell is None:
        return

    # ------------------------------------------------------------------
    # JSON-safe plain values
    # ------------------------------------------------------------------

    def plain(value, depth=0):
        """Turn one value into something json.dumps(allow_nan=False) takes."""
        if value is None or isinstance(value, (str, bool)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else None
        pd = sys.modules.get("pandas")
        if pd is not None:
            if value is pd.NaT or value is getattr(pd, "NA", None):
                return None
            if isinstance(value, pd.Timestamp):
                return value.isoformat()
            if isinstance(value, pd.Timedelta):
                return str(value)
            if isinstance(value, (pd.Period, pd.Interval)):
                return str(value)
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(value, np.generic):
                if isinstance(value, np.bool_):
                    return bool(value)
                if isinstance(value, np.integer):
                    return int(value)
                if isinstance(value, np.floating):
                    number = float(value)
                    return number if math.isfinite(number) else None
                if isinstance(value, np.datetime64):
                    if np.isnat(value):
                        return None
                    return str(np.datetime_as_string(value))
                if isinstance(value, np.timedelta64):
                    return None if np.isnat(value) else str(value)
                if isinstance(value, (np.str_, np.bytes_)):
                    return plain(value.item(), depth)
                return str(value)
            if isinstance(value, np.ndarray) and depth < 8:
                return [plain(item, depth + 1) for item in value.tolist()]
        if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
            return value.isoformat()
        if isinstance(value, datetime.timedelta):
            return str(value)
        if isinstance(value, decimal.Decimal):
            return float(value) if value.is_finite() else None
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if depth < 8:
            if isinstance(value, (list, tuple)):
                return [plain(item, depth + 1) for item in value]
            if isinstance(value, dict):
                return {key_text(k): plain(v, depth + 1) for k, v in value.items()}
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            number = float(value)
            return number if math.isfinite(number) else None
        return str(value)

    def key_text(key):
        return key if isinstance(key, str) else str(plain(key))

    # ------------------------------------------------------------------
    # e2b/data: pandas DataFrame -> {column: [values]}
    # ------------------------------------------------------------------

    def column_values(column):
        """One column as a JSON-safe list; vectorised for plain numpy dtypes."""
        np = sys.modules.get("numpy")
        dtype = column.dtype
        if np is not None and isinstance(dtype, np.dtype):
            if dtype.kind in "iub":
                return column.to_numpy().tolist()
            if dtype.kind == "f":
                array = column.to_numpy()
                finite = np.isfinite(array)
                if finite.all():
                    return array.tolist()
                boxed = array.astype(object)
                boxed[~finite] = None
                return boxed.tolist()
            if dtype.kind == "M":
                # what Timestamp.isoformat() gives, value by value: whole
                # seconds, else microseconds, else nanoseconds
                array = column.to_numpy().astype("datetime64[ns]")
                missing = np.isnat(array)
                ticks = array.view("i8")
                boxed = np.datetime_as_string(array, unit="s").astype(object)
                for unit, divisor in (("us", 1000000000), ("ns", 1000)):
                    finer = ~missing & (ticks % divisor != 0)
                    if finer.any():
                        boxed[finer] = np.datetime_as_string(
                            array[finer], unit=unit
                        ).astype(object)
                boxed[missing] = None
                return boxed.tolist()
        return [plain(item) for item in column.tolist()]

    # The most cells a frame's e2b/data is made for: the driver drops a MIME value over
    # 8 MiB anyway, and a large frame's lists would cost the kernel time and memory (a
    # 200 MB frame's as Python objects would not fit a small sandbox). Larger frames keep
    # their text/html, capped as usual.
    data_cells_max = 250_000

    def frame_data(frame):
        if frame.shape[0] * max(frame.shape[1], 1) > data_cells_max:
            return None
        columns = {}
        for position, name in enumerate(frame.columns):
            key = key_text(name)
            if key in columns:
                continue  # duplicate label: keep the first, like to_dict()
            columns[key] = column_values(frame.iloc[:, position])
        return columns

    # ------------------------------------------------------------------
    # e2b/chart: matplotlib Figure -> E2B chart dict
    # ------------------------------------------------------------------

    unit_pattern = re.compile(r"(?:^|\s)\(([^()]+)\)|\[([^\[\]]+)\]")

    def text_or_none(text):
        if text is None:
            return None
        text = str(text)
        return text if text else None

    def unit_of(label):
        if not label:
            return None
        found = unit_pattern.search(label)
        if found is None:
            return None
        return (found.group(1) or found.group(2)).strip() or None

    def title_of(ax):
        for where in ("center", "left", "right"):
            title = ax.get_title(where)
            if title:
                return title
        return None

    def suptitle_of(figure):
        getter = getattr(figure, "get_suptitle", None)
        if getter is not None:
            return text_or_none(getter())
        sup = getattr(figure, "_suptitle", None)
        return text_or_none(sup.get_text()) if sup is not None else None

    def tidy(number, digits=10):
        """A float with binary noise removed (324.00000000000006 -> 324.0)."""
        number = float(number)
        if not math.isfinite(number):
            return None
        return float("%.*g" % (digits, number))

    def number_text(number):
        number = float(number)
        if number.is_integer():
            return str(int(number))
        return "%g" % number

    def axis_kind(axis):
        """'datetime', 'categorical', 'pandas-period' or None for an Axis."""
        converter = getattr(axis, "converter", None)
        module = type(converter).__module__ if converter is not None else ""
        if module == "matplotlib.dates":
            return "datetime"
        if module == "matplotlib.category":
            return "categorical"
        locator = axis.get_major_locator()
        formatter = axis.get_major_formatter()
        if type(locator).__name__.startswith("TimeSeries_Date") or type(
            formatter
        ).__name__.startswith("TimeSeries_Date"):
            return "pandas-period"
        mdates = sys.modules.get("matplotlib.dates")
        if mdates is not None and isinstance(locator, mdates.DateLocator):
            return "datetime"
        return None

    class AxisInfo:
        def __init__(self, ax, axis, scale):
            self.axis = axis
            self.kind = axis_kind(axis)
            if self.kind in ("datetime", "pandas-period"):
                self.scale = "datetime"
            elif self.kind == "categorical":
                self.scale = "categorical"
            else:
                self.scale = scale or "linear"
            self.period_freq = None
            if self.kind == "pandas-period":
                self.period_freq = getattr(
                    axis.get_major_formatter(), "freq", None
                ) or getattr(ax, "freq", None)
            self.categories = {}
            if self.kind == "categorical":
                mapping = getattr(getattr(axis, "units", None), "_mapping", None)
                if mapping:
                    self.categories = {float(i): str(n) for n, i in mapping.items()}
            self.ticks = self._ticks()

        def to_text_position(self, number):
            """A data-axis number as the ISO string / category it stands for."""
            number = float(number)
            if not math.isfinite(number):
                return None
            if self.kind == "datetime":
                return sys.modules["matplotlib.dates"].num2date(number).isoformat()
            if self.kind == "pandas-period":
                pd = sys.modules["pandas"]
                period = pd.Period(ordinal=int(round(number)), freq=self.period_freq)
                return period.start_time.isoformat()
            if self.kind == "categorical" and number in self.categories:
                return self.categories[number]
            return None

        def _ticks(self):
            locs = [float(t) for t in self.axis.get_majorticklocs()]
            try:
                labels = list(self.axis.get_major_formatter().format_ticks(locs))
            except Exception:
                labels = [""] * len(locs)
            low, high = sorted(float(v) for v in self.axis.get_view_interval())
            slack = (high - low) * 1e-9 if math.isfinite(high - low) else 0.0
            ticks = []
            for loc, label in zip(locs, labels):
                if low - slack <= loc <= high + slack:
                    ticks.append((loc, str(label)))
            return ticks

        def tick_values(self):
            values = []
            for loc, _ in self.ticks:
                text = None
                if self.kind in ("datetime", "pandas-period"):
                    try:
                        text = self.to_text_position(loc)
                    except Exception:
                        text = None
                values.append(text if text is not None else tidy(loc))
            return values

        def tick_labels(self):
            return [label for _, label in self.ticks]

        def label_at(self, center, low, high):
            """The category / tick label for a bar or box spanning low..high."""
            if self.kind == "categorical" and float(center) in self.categories:
                return self.categories[float(center)]
            # Ticks the user placed (set_xticks(pos, labels), boxplot
            # labels) name the bar or box they sit on; automatic numeric
            # ticks name nothing, the position itself is the label then.
            fixed = type(self.axis.get_major_locator()).__name__ == "FixedLocator"
            slack = 1e-9 * max(1.0, abs(center)) + (high - low) * 1e-6
            best = None
            for loc, label in self.ticks if fixed else ():
                if not label or not (low - slack <= loc <= high + slack):
                    continue
                distance = abs(loc - center)
                if best is None or distance < best[0]:
                    best = (distance, label)
            if best is not None:
                return best[1]
            try:
                text = self.to_text_position(center)
            except Exception:
                text = None
            return text if text is not None else number_text(center)

        def point_value(self, value):
            """One coordinate of a plotted point, as the schema wants it."""
            if isinstance(value, str):
                return value
            np = sys.modules.get("numpy")
            is_number = isinstance(value, numbers.Real) and not isinstance(
                value, bool
            )
            if np is not None and isinstance(value, (np.integer, np.floating)):
                is_number = True
            if is_number:
                number = float(value)
                if not math.isfinite(number):
                    return None
                if self.kind is not None:
                    try:
                        text = self.to_text_position(number)
                    except Exception:
                        text = None
                    if text is not None:
                        return text
                return number
            pd = sys.modules.get("pandas")
            if pd is not None and isinstance(value, pd.Period):
                return value.start_time.isoformat()
            return plain(value)

    def axes_labels(ax):
        x_label = text_or_none(ax.get_xlabel())
        y_label = text_or_none(ax.get_ylabel())
        return {
            "x_label": x_label,
            "y_label": y_label,
            "x_unit": unit_of(x_label),
            "y_unit": unit_of(y_label),
        }

    def swap_axes_labels(labels):
        return {
            "x_label": labels["y_label"],
            "y_label": labels["x_label"],
            "x_unit": labels["y_unit"],
            "y_unit": labels["x_unit"],
        }

    def series_name(label, kind, index):
        label = "" if label is None else str(label)
        if label.startswith("_child") and label[6:].isdigit():
            return "%s %s" % (kind, label[6:])
        if not label or label.startswith("_"):
            return "%s %d" % (kind, index)
        return label

    def is_marker_only(line):
        style = line.get_linestyle()
        marker = line.get_marker()
        no_line = style in (None, "None", "none", "", " ")
        has_marker = marker not in (None, "None", "none", "", " ")
        return no_line and has_marker

    def numeric_xy(line):
        np = sys.modules["numpy"]
        xs = np.asarray(line.get_xdata(orig=False), dtype=float).ravel()
        ys = np.asarray(line.get_ydata(orig=False), dtype=float).ravel()
        return xs, ys

    # --- point charts (line / scatter) --------------------------------

    def point_chart(ax, kind, lines, collections):
        x_info = AxisInfo(ax, ax.xaxis, ax.get_xscale())
        y_info = AxisInfo(ax, ax.yaxis, ax.get_yscale())
        elements = []
        for index, line in enumerate(lines):
            xs = line.get_xdata()
            ys = line.get_ydata()
            points = [
                [x_info.point_value(x), y_info.point_value(y)]
                for x, y in zip(list(xs), list(ys))
            ]
            elements.append(
                {"label": series_name(line.get_label(), "Line", index),
                 "points": points}
            )
        for index, collection in enumerate(collections):
            offsets = collection.get_offsets()
            points = []
            for row in offsets:
                if len(row) < 2:
                    continue
                points.append([x_info.point_value(row[0]), y_info.point_value(row[1])])
            elements.append(
                {"label": series_name(collection.get_label(), "Scatter", index),
                 "points": points}
            )
        chart = {"type": kind, "title": title_of(ax)}
        chart.update(axes_labels(ax))
        chart.update(
            {
                "x_ticks": x_info.tick_values(),
                "x_tick_labels": x_info.tick_labels(),
                "x_scale": x_info.scale,
                "y_ticks": y_info.tick_values(),
                "y_tick_labels": y_info.tick_labels(),
                "y_scale": y_info.scale,
                "elements": elements,
            }
        )
        return chart

    # --- bar charts ---------------------------------------------------

    def bar_chart(ax, containers):
        x_info = AxisInfo(ax, ax.xaxis, ax.get_xscale())
        y_info = AxisInfo(ax, ax.yaxis, ax.get_yscale())
        elements = []
        horizontal = None
        for index, container in enumerate(containers):
            group = container.get_label()
            group = "" if group is None else str(group)
            if group.startswith("_container") and group[10:].isdigit():
                group = "Group %s" % group[10:]
            elif not group or group.startswith("_"):
                group = "Group %d" % index
            patches = list(container.patches)
            orientation = getattr(container, "orientation", None)
            if orientation not in ("vertical", "horizontal"):
                widths = [p.get_width() for p in patches]
                flat = len(patches) > 1 and all(w == widths[0] for w in widths)
                orientation = "vertical" if flat else "horizontal"
            if horizontal is None:
                horizontal = orientation == "horizontal"
            values = getattr(container, "datavalues", None)
            if values is None:
                values = [
                    p.get_width() if orientation == "horizontal" else p.get_height()
                    for p in patches
                ]
            values = list(values)
            for patch, value in zip(patches, values):
                if orientation == "horizontal":
                    start, size, info = patch.get_y(), patch.get_height(), y_info
                else:
                    start, size, info = patch.get_x(), patch.get_width(), x_info
                low, high = sorted((float(start), float(start) + float(size)))
                label = info.label_at((low + high) / 2.0, low, high)
                elements.append(
                    {"label": label, "group": group, "value": plain(value)}
                )
        labels = axes_labels(ax)
        if horizontal:
            labels = swap_axes_labels(labels)
        chart = {"type": "bar", "title": title_of(ax)}
        chart.update(labels)
        chart["elements"] = elements
        return chart

    # --- pie charts ---------------------------------------------------

    def pie_chart(ax, wedges):
        elements = []
        for wedge in wedges:
            elements.append(
                {
                    "label": str(wedge.get_label() or ""),
                    # pie() works in float32: keep 7 significant digits
                    "angle": tidy(abs(float(wedge.theta2) - float(wedge.theta1)), 7),
                    "radius": tidy(wedge.r),
                }
            )
        return {"type": "pie", "title": title_of(ax), "elements": elements}

    # --- box and whisker charts ---------------------------------------

    def close(a, b, tolerance):
        return abs(a - b) <= tolerance

    def box_stats(boxes, segments, markers, vertical):
        """Read boxplot statistics off the drawn geometry.

        boxes: [(xlo, xhi, ylo, yhi)]; segments: [(xs, ys)] two-point lines;
        markers: [(xs, ys)] marker-only lines.  With vertical=True the
        category runs along x and the values along y; otherwise swapped.
        Returns (score, stats) where score counts boxes that really look
        like boxplot boxes (both whiskers and a median found).
        """
        results = []
        score = 0
        for xlo, xhi, ylo, yhi in boxes:
            if vertical:
                plo, phi, vlo, vhi = xlo, xhi, ylo, yhi
            else:
                plo, phi, vlo, vhi = ylo, yhi, xlo, xhi
            tolerance = 1e-9 * max(1.0, abs(vlo), abs(vhi), abs(plo), abs(phi))
            inside = []
            for xs, ys in segments:
                ps, vs = (xs, ys) if vertical else (ys, xs)
                if min(ps) < plo - tolerance or max(ps) > phi + tolerance:
                    continue
                inside.append((ps, vs))
            # Whiskers run along the value axis from the box outwards; the
            # end touching the box is a quartile (a notched box's outline
            # can reach past the quartiles, so the outline alone won't do).
            lower = upper = None
            for ps, vs in inside:
                if not close(ps[0], ps[1], tolerance):
                    continue
                v_low, v_high = min(vs), max(vs)
                if (lower is None and v_low <= vlo + tolerance
                        and vlo - tolerance <= v_high < vhi - tolerance):
                    lower = (v_low, v_high)
                elif (upper is None and v_high >= vhi - tolerance
                        and vlo + tolerance < v_low <= vhi + tolerance):
                    upper = (v_low, v_high)
            q1 = lower[1] if lower is not None else vlo
            q3 = upper[0] if upper is not None else vhi
            # The median crosses the box: the widest such line inside it.
            median = None
            median_span = -1.0
            for ps, vs in inside:
                if not close(vs[0], vs[1], tolerance):
                    continue
                if q1 - tolerance <= vs[0] <= q3 + tolerance:
                    span = max(ps) - min(ps)
                    if span > median_span + tolerance:
                        median, median_span = vs[0], span
            if lower is not None and upper is not None and median is not None:
                score += 1
            low_end = q1 if lower is None else lower[0]
            high_end = q3 if upper is None else upper[1]
            outliers = []
            for xs, ys in markers:
                ps, vs = (xs, ys) if vertical else (ys, xs)
                for p, v in zip(ps, vs):
                    if not (plo - tolerance <= p <= phi + tolerance):
                        continue
                    if v < low_end - tolerance or v > high_end + tolerance:
                        outliers.append(tidy(v))
            results.append(
                {
                    "position": (plo, phi),
                    "min": tidy(low_end),
                    "first_quartile": tidy(q1),
                    "median": tidy(median) if median is not None else None,
                    "third_quartile": tidy(q3),
                    "max": tidy(high_end),
                    "outliers": outliers,
                }
            )
        return score, results

    def box_chart(ax, lines, patches):
        np = sys.modules["numpy"]
        boxes, segments, markers = [], [], []
        for patch in patches:
            if type(patch).__name__ != "PathPatch":
                return None
            vertices = np.asarray(patch.get_path().vertices, dtype=float)
            if vertices.ndim != 2 or len(vertices) < 4:
                return None
            boxes.append(
                (vertices[:, 0].min(), vertices[:, 0].max(),
                 vertices[:, 1].min(), vertices[:, 1].max())
            )
        for line in lines:
            xs, ys = numeric_xy(line)
            if len(xs) != len(ys):
                return None
            if is_marker_only(line):
                markers.append((xs, ys))
            elif len(xs) == 2:
                segments.append((xs, ys))
            elif len(xs) >= 5 and xs[0] == xs[-1] and ys[0] == ys[-1]:
                boxes.append((xs.min(), xs.max(), ys.min(), ys.max()))
            else:
                return None
        if not boxes or not segments:
            return None
        boxes.sort(key=lambda b: (b[0], b[2]))
        best = None
        for vertical in (True, False):
            score, stats = box_stats(boxes, segments, markers, vertical)
            if best is None or score > best[0]:
                best = (score, stats, vertical)
        score, stats, vertical = best
        if score < len(boxes) or any(s["median"] is None for s in stats):
            return None
        category = AxisInfo(ax, ax.xaxis if vertical else ax.yaxis,
                            ax.get_xscale() if vertical else ax.get_yscale())
        stats.sort(key=lambda s: s["position"][0])
        elements = []
        for item in stats:
            low, high = item.pop("position")
            element = {"label": category.label_at((low + high) / 2.0, low, high)}
            element.update(item)
            elements.append(element)
        labels = axes_labels(ax)
        if not vertical:
            labels = swap_axes_labels(labels)
        chart = {"type": "box_and_whisker", "title": title_of(ax)}
        chart.update(labels)
        chart["elements"] = elements
        return chart

    # --- one Axes -> one chart ----------------------------------------

    def axes_chart(ax):
        mlines = sys.modules["matplotlib.lines"]
        mpatches = sys.modules["matplotlib.patches"]
        mcollections = sys.modules["matplotlib.collections"]
        mtext = sys.modules["matplotlib.text"]
        mcontainer = sys.modules.get("matplotlib.container")

        children = getattr(ax, "_children", None)
        if children is None:
            children = (
                list(ax.lines) + list(ax.patches) + list(ax.collections)
                + list(ax.images) + list(getattr(ax, "tables", []))
                + list(ax.artists)
            )
        bar_containers = []
        errorbar_parts = set()
        for container in getattr(ax, "containers", []):
            if mcontainer is not None and isinstance(container, mcontainer.BarContainer):
                bar_containers.append(container)
                errorbar = getattr(container, "errorbar", None)
                if errorbar is not None:
                    for part in errorbar.get_children():
                        errorbar_parts.add(id(part))
        lines, patches, collections, others = [], [], [], []
        for artist in children:
            if isinstance(artist, mtext.Text) or not artist.get_visible():
                continue
            if isinstance(artist, mlines.Line2D):
                # axhline / axvline and friends are not in data coordinates
                if artist.get_transform() is not ax.transData and id(
                    artist
                ) not in errorbar_parts:
                    continue
                lines.append(artist)
            elif isinstance(artist, mpatches.Patch):
                patches.append(artist)
            elif isinstance(artist, mcollections.Collection):
                collections.append(artist)
            else:
                others.append(artist)

        title = title_of(ax)
        unknown = {"type": "unknown", "title": title, "elements": []}
        if not (lines or patches or collections or others):
            return unknown
        if others:
            return unknown

        if patches and not lines and not collections and all(
            isinstance(p, mpatches.Wedge) for p in patches
        ):
            return pie_chart(ax, patches)

        if not collections and (lines or patches):
            chart = box_chart(ax, lines, patches)
            if chart is not None:
                return chart

        if (
            patches
            and bar_containers
            and all(isinstance(p, mpatches.Rectangle) for p in patches)
            and all(id(a) in errorbar_parts for a in lines + collections)
        ):
            return bar_chart(ax, bar_containers)

        if patches:
            return unknown
        path_collections = [
            c for c in collections if isinstance(c, mcollections.PathCollection)
        ]
        if len(path_collections) != len(collections):
            return unknown
        if lines and not collections:
            return point_chart(ax, "line", lines, [])
        if collections:
            return point_chart(ax, "scatter", lines, path_collections)
        return unknown

    def figure_chart(figure):
        axes = [
            ax
            for ax in figure.get_axes()
            if ax.get_visible() and getattr(ax, "_colorbar", None) is None
        ]
        if not axes or not any(ax.has_data() for ax in axes):
            return None
        if len(axes) == 1:
            chart = axes_chart(axes[0])
            if chart.get("title") is None:
                chart["title"] = suptitle_of(figure)
            return chart
        return {
            "type": "superchart",
            "title": suptitle_of(figure),
            "elements": [axes_chart(ax) for ax in axes],
        }

    # ------------------------------------------------------------------
    # the two IPython formatters
    # ------------------------------------------------------------------

    def quietly(produce, obj):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = produce(obj)
            if result is None:
                return None
            result = plain(result)
            return result if isinstance(result, dict) and result else None
        except Exception:
            return None

    def by_print_method(formatter, obj):
        """IPython's usual lookup (for_type registrations, _repr_e2b_*_)."""
        try:
            result = BaseFormatter.__call__(formatter, obj)
        except Exception:
            return None
        return None if result is None else quietly(lambda value: value, result)

    class LockerDataFormatter(BaseFormatter):
        """e2b/data: column lists of a pandas DataFrame."""

        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            if not self.enabled:
                return None
            pd = sys.modules.get("pandas")
            if pd is not None:
                frame_type = getattr(pd, "DataFrame", None)
                if frame_type is not None and isinstance(obj, frame_type):
                    return quietly(frame_data, obj)
            return by_print_method(self, obj)

    class LockerChartFormatter(BaseFormatter):
        """e2b/chart: E2B's chart schema for a matplotlib Figure."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            if not self.enabled:
                return None
            figure_module = sys.modules.get("matplotlib.figure")
            if figure_module is not None:
                figure_type = getattr(figure_module, "Figure", None)
                if figure_type is not None and isinstance(obj, figure_type):
                    return quietly(figure_chart, obj)
            return by_print_method(self, obj)

    formatters = shell.display_formatter.formatters
    formatters["e2b/data"] = LockerDataFormatter(parent=shell.display_formatter)
    formatters["e2b/chart"] = LockerChartFormatter(parent=shell.display_formatter)

    # ------------------------------------------------------------------
    # PIL: display on Image.save(path), display instead of a viewer
    # ------------------------------------------------------------------

    state = {"busy": 0}
    marker = "_locker_display_hook"

    def png_of(image, save):
        """PNG bytes of a PIL image; modes PNG can't hold go through RGBA."""
        for convert in (False, True):
            try:
                source = image.convert("RGBA") if convert else image
                buffer = io.BytesIO()
                save(source, buffer, "PNG")
                return buffer.getvalue()
            except Exception:
                continue
        return None

    def display_image(image, save):
        if state["busy"]:
            return
        state["busy"] += 1
        try:
            png = png_of(image, save)
            if png is None:
                return
            try:
                text = repr(image)
            except Exception:
                text = "<PIL image>"
            from IPython.display import display

            display(
                {"image/png": base64.b64encode(png).decode("ascii"),
                 "text/plain": text},
                raw=True,
            )
        except Exception:
            pass
        finally:
            state["busy"] -= 1

    def patch_image_module(module):
        image_class = getattr(module, "Image", None)
        if image_class is None or getattr(image_class.save, marker, False):
            return
        original_save = image_class.save

        @functools.wraps(original_save)
        def save(self, fp, format=None, **params):
            state["busy"] += 1
            try:
                result = original_save(self, fp, format, **params)
            finally:
                state["busy"] -= 1
            if isinstance(fp, (str, os.PathLike)):
                display_image(self, original_save)
            return result

        @functools.wraps(image_class.show)
        def show(self, title=None):
            display_image(self, original_save)

        setattr(save, marker, True)
        setattr(show, marker, True)
        image_class.save = save
        image_class.show = show

    def patch_imageshow_module(module):
        def save_with(image):
            pil_image = sys.modules.get("PIL.Image")
            image_class = getattr(pil_image, "Image", None)
            original = getattr(image_class, "save", None)
            return getattr(original, "__wrapped__", original)

        if not getattr(getattr(module, "show", None), marker, False):
            def show(image, title=None, **options):
                display_image(image, save_with(image))
                return 1

            setattr(show, marker, True)
            module.show = show
        viewer = getattr(module, "Viewer", None)
        if viewer is not None and not getattr(viewer.show, marker, False):
            def viewer_show(self, image, **options):
                display_image(image, save_with(image))
                return 1

            setattr(viewer_show, marker, True)
            viewer.show = viewer_show

    patchers = {"PIL.Image": patch_image_module,
                "PIL.ImageShow": patch_imageshow_module}

    class LockerPILImportHook:
        """Patches PIL.Image / PIL.ImageShow right after user code imports them."""

        def find_spec(self, fullname, path=None, target=None):
            patcher = patchers.get(fullname)
            if patcher is None:
                return None
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
            if spec is None:
                return None
            loader = spec.loader
            real_exec = getattr(loader, "exec_module", None)
            if real_exec is None:
                return spec

            def exec_module(module):
                try:
                    real_exec(module)
                finally:
                    try:
                        del loader.exec_module
                    except Exception:
                        pass
                if getattr(module, "__name__", None) == fullname:
                    try:
                        patcher(module)
                    except Exception:
                        pass

            try:
                loader.exec_module = exec_module
            except Exception:
                pass
            return spec

        def invalidate_caches(self):
            pass

    for name, patcher in patchers.items():
        module = sys.modules.get(name)
        if module is not None:
            try:
                patcher(module)
            except Exception:
                pass
    if not any(type(f).__name__ == "LockerPILImportHook" for f in sys.meta_path):
        sys.meta_path.insert(0, LockerPILImportHook())


try:
    __locker_display_setup()
finally:
    del __locker_display_setup
