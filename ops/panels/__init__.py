"""Render Grafana dashboard panels to PNG from scraped metrics, with no Grafana or Prometheus server.

`make demo` runs a short load against a live Shunter app, scrapes Ray's metrics endpoint every couple
of seconds into a `SampleStore` (`scrape`), evaluates the generated dashboards' own PromQL queries over
those samples (`promql`) and draws the key panels with matplotlib (`render`); the README shows one of
the images. Rendering the real dashboard JSON, rather than hand-written plots, also proves that the
dashboards' queries name metrics that really exist and return data.

The evaluator implements the subset of PromQL the dashboards use:

- selectors: instant (5 min lookback) and range, matchers `=`, `!=`, `=~`, `!~` (fully anchored
  regexes), `{a="x" or b="y"}`, `offset`;
- functions: `rate`, `irate`, `increase`, `delta`, `idelta`, `histogram_quantile`,
  `avg/sum/min/max/count/last_over_time`, `abs`, `ceil`, `floor`, `round`, `sqrt`, `exp`, `ln`, `log2`,
  `log10`, `clamp`, `clamp_min`, `clamp_max`, `vector`, `scalar`, `time`, `label_replace`;
- aggregations `sum`, `avg`, `min`, `max`, `count`, `group`, `stddev`, `stdvar`, `quantile`, `topk`,
  `bottomk`, with `by (...)` / `without (...)`;
- binary `+ - * / % ^ atan2` and comparisons (with or without `bool`) between scalars and vectors,
  one-to-one vector matching with `on(...)` / `ignoring(...)`, `group_left` / `group_right`, and the
  set operators `and`, `or`, `unless`;
- Grafana variables via `promql.interpolate`: `$__rate_interval`, `$__interval`, `$__range` (and their
  `_ms`/`_s` forms), `$name`, `${name}`, `${name:format}`; "All" becomes `.*`.

Known limits, where numbers can differ from what Prometheus and Grafana would show:

- `rate` is (reset-corrected increase between the first and last sample in the window) / (time
  between them), with at least two samples needed; there is no Prometheus-style extrapolation to the
  window's edges, so a series that starts inside the window shows its true recent rate instead of a
  ramp. `increase` and `delta` are that rate times the window, so `increase == rate * range` holds.
- No staleness markers: a series that vanished from the scrapes stays visible for the 5 min lookback.
- Samples are stamped with the scrape's time; timestamps in the exposition are ignored.
- Unsupported (raise `UnsupportedPromQL`, naming the construct): subqueries, the `@` modifier, fill
  modifiers, `count_values`, `limitk`, native histograms, and every function not listed above
  (`predict_linear`, `label_join`, `absent`, `changes`, `resets`, `deriv`, ...).
- Variable values are inserted as-is: no regex escaping of multi-value selections, and a variable with
  no saved value means "All" (there is no Grafana to run its options query).
- Drawing approximates Grafana: stat and gauge panels show the reduced value over a sparkline (no
  dial), thresholds, overrides and transformations are ignored, and common units are formatted.
"""
