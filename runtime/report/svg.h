// The inline SVG figures of `ft report`: line charts, stacked areas, a heat map, bars and a
// timeline, each with a title, axes with ticks and labels, units and a legend where several series
// share it. Every drawn series carries data-series="<name>" data-points="<n>" so that a browser
// test can count what was drawn. Plain text out, no scripts, no external resources. Pure
// functions; thread-safe.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace ft::report {

// How an axis writes its tick values: "%g", bytes as "1.5 GiB", percentages.
using TickFormat = std::function<std::string(double)>;
std::string format_number(double v);
std::string format_bytes(double v);
std::string format_percent(double fraction);  // 0.123 -> "12.3%"

struct Series {
  std::string name;   // data-series and the legend
  std::string label;  // the legend's text ("" = name)
  std::string color;  // CSS colour
  std::vector<double> x, y;
  bool dashed = false;
  bool markers = false;  // a dot per point (sparse series: eval loss, skipped steps)
  double width = 1.6;
};

// A long run's series made light enough to draw: at most about `max_points` points. Each of
// max_points / 2 ranges of points keeps its lowest and its highest (in x order), so spikes stay
// visible; a series with fewer points is returned as it is.
Series thin_extremes(Series s, size_t max_points = 2000);
// The same for the parts of a stacked chart: each of max_points ranges becomes one point, the
// means of its x and y (every part of the stack thinned alike keeps the stack's sums).
Series thin_mean(Series s, size_t max_points = 1000);

struct Chart {
  std::string id;  // the figure's data-chart attribute
  std::string title;
  std::string x_label, y_label;  // with units: "step", "loss (nats/token)"
  TickFormat y_format;           // null = format_number
  bool y_from_zero = false;
  double width = 560, height = 270;
};

// A line chart of `series` (a legend when there are several). With no point at all it says so.
std::string line_chart(const Chart& chart, const std::vector<Series>& series);

// Stacked areas: layer k's top at x[i] is the sum of series 0..k at i (all series share x).
std::string stacked_chart(const Chart& chart, const std::vector<Series>& series);

// Rows (ranks) by columns (step ranges) coloured by value; `cells[row][col]` (NaN: no record).
struct HeatMap {
  std::vector<std::string> row_labels;
  std::vector<double> column_steps;  // the last step of each column
  std::vector<std::vector<double>> cells;
};
std::string heat_map(const Chart& chart, const HeatMap& map);

// Bars per group (rank), one bar per series in each group, and optional horizontal reference
// lines (the plan's figures).
struct Bars {
  std::vector<std::string> groups;
  std::vector<Series> series;  // series[k].y[g]: group g's bar of series k
  std::vector<Series> lines;   // lines[k].y[0]: a dashed horizontal line across the chart
};
std::string bar_chart(const Chart& chart, const Bars& bars);

// Markers on a step axis, one row per kind.
struct Mark {
  double step = 0;
  int row = 0;
  std::string tip;  // the marker's tooltip (<title>)
};
std::string timeline(const Chart& chart, const std::vector<std::string>& rows,
                     const std::vector<std::string>& row_colors, const std::vector<Mark>& marks,
                     double max_step);

// Escapes text for HTML and SVG (&, <, >, ").
std::string escape(const std::string& text);

}  // namespace ft::report
