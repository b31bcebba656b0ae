#include "report/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace ft::report {

namespace {

constexpr double kLeft = 70, kRight = 18, kTop = 48, kBottom = 46;

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// About `want` round tick values covering [lo, hi] (1, 2 or 5 times a power of ten apart); the
// range is widened to the outer ticks.
std::vector<double> nice_ticks(double& lo, double& hi, int want = 5) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) {
    lo = 0;
    hi = 1;
  }
  // A range that is empty or too narrow for its magnitude (one step's loss and its smoothed value
  // a last bit apart: a tick step below the values' resolution never advances) is widened first.
  if (!(hi - lo > std::max(std::abs(lo), std::abs(hi)) * 1e-9)) {
    const double mid = (lo + hi) / 2;
    const double pad = mid == 0 ? 1 : std::abs(mid) * 0.1;
    lo = mid - pad;
    hi = mid + pad;
  }
  const double raw = (hi - lo) / want;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  lo = std::floor(lo / step + 1e-9) * step;
  hi = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> ticks;
  for (int i = 0; i <= 4 * want; ++i) {  // at most about `want` + 2; the bound is a safeguard
    const double t = lo + i * step;
    if (t > hi + step * 1e-6) break;
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
  }
  return ticks;
}

struct Frame {
  double x0, x1, y0, y1, w, h;
  double px(double x) const { return kLeft + (x - x0) / (x1 - x0) * (w - kLeft - kRight); }
  double py(double y) const { return h - kBottom - (y - y0) / (y1 - y0) * (h - kTop - kBottom); }
};

std::string open_svg(const Chart& c) {
  return fmt::format(
      "<figure class=\"chart\" data-chart=\"{}\"><svg viewBox=\"0 0 {} {}\" width=\"{}\" "
      "height=\"{}\" role=\"img\" aria-label=\"{}\">"
      "<text class=\"title\" x=\"{}\" y=\"20\">{}</text>",
      escape(c.id), c.width, c.height, c.width, c.height, escape(c.title), kLeft, escape(c.title));
}

std::string close_svg() { return "</svg></figure>\n"; }

std::string empty_chart(const Chart& c, const std::string& why) {
  return open_svg(c) +
         fmt::format("<text class=\"empty\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                     c.width / 2, c.height / 2, escape(why)) +
         close_svg();
}

// Axes, grid lines, tick labels and the axis titles of frame `f`.
std::string axes(const Chart& c, const Frame& f, const std::vector<double>& xt,
                 const std::vector<double>& yt, const TickFormat& xfmt) {
  const TickFormat yfmt = c.y_format ? c.y_format : TickFormat(format_number);
  std::string s = "<g class=\"axes\">";
  for (double t : yt) {
    const double y = f.py(t);
    s += fmt::format(
        "<line class=\"grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>"
        "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>",
        kLeft, y, f.w - kRight, y, kLeft - 6, y + 4, escape(yfmt(t)));
  }
  for (double t : xt) {
    const double x = f.px(t);
    s += fmt::format(
        "<line class=\"tickmark\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>"
        "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
        x, f.h - kBottom, x, f.h - kBottom + 5, x, f.h - kBottom + 18, escape(xfmt(t)));
  }
  s += fmt::format(
      "<line class=\"axis\" x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2:.1f}\"/>"
      "<line class=\"axis\" x1=\"{0}\" y1=\"{2:.1f}\" x2=\"{3:.1f}\" y2=\"{2:.1f}\"/>",
      kLeft, kTop, f.h - kBottom, f.w - kRight);
  s += fmt::format(
      "<text class=\"label\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
      (kLeft + f.w - kRight) / 2, f.h - 8, escape(c.x_label));
  s += fmt::format(
      "<text class=\"label\" transform=\"translate(14,{:.1f}) rotate(-90)\" "
      "text-anchor=\"middle\">{}</text></g>",
      (kTop + f.h - kBottom) / 2, escape(c.y_label));
  return s;
}

// The legend, a row under the title, one entry per series (only when there are several).
std::string legend(const Chart& c, const std::vector<Series>& series, bool boxes = false) {
  if (series.size() < 2) return "";
  std::string s = "<g class=\"legend\">";
  double x = kLeft;
  for (const auto& se : series) {
    const std::string text = se.label.empty() ? se.name : se.label;
    const double w = 28 + 6.4 * static_cast<double>(text.size());
    if (x + w > c.width - kRight && x > kLeft) break;  // (never wider than the chart)
    s += boxes ? fmt::format("<rect x=\"{:.1f}\" y=\"29\" width=\"10\" height=\"10\" fill=\"{}\"/>",
                             x, se.color)
               : fmt::format(
                     "<line x1=\"{:.1f}\" y1=\"34\" x2=\"{:.1f}\" y2=\"34\" stroke=\"{}\" "
                     "stroke-width=\"2.5\"{}/>",
                     x, x + 14, se.color, se.dashed ? " stroke-dasharray=\"5 3\"" : "");
    s += fmt::format("<text x=\"{:.1f}\" y=\"38\">{}</text>", x + 17, escape(text));
    x += w;
  }
  return s + "</g>";
}

std::string format_step(double v) { return fmt::format("{:.0f}", v); }

std::string polyline(const Frame& f, const Series& s) {
  std::string pts;
  int n = 0;
  for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
    if (!std::isfinite(s.y[i])) continue;
    pts += fmt::format("{}{:.1f},{:.1f}", n ? " " : "", f.px(s.x[i]), f.py(s.y[i]));
    ++n;
  }
  std::string out;
  if (s.markers) {
    out += fmt::format("<g class=\"markers\" data-series=\"{}\" data-points=\"{}\" fill=\"{}\">",
                       escape(s.name), n, s.color);
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
      if (std::isfinite(s.y[i]))
        out += fmt::format(
            "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\"><title>step {:.0f}: {}</title></circle>",
            f.px(s.x[i]), f.py(s.y[i]), s.x[i], format_number(s.y[i]));
    return out + "</g>";
  }
  return fmt::format(
      "<polyline data-series=\"{}\" data-points=\"{}\" fill=\"none\" stroke=\"{}\" "
      "stroke-width=\"{}\" stroke-linejoin=\"round\"{} points=\"{}\"/>",
      escape(s.name), n, s.color, s.width, s.dashed ? " stroke-dasharray=\"5 3\"" : "", pts);
}

// A colour on a blue -> yellow -> red ramp, t in [0, 1].
std::string ramp(double t) {
  static const double stops[][3] = {{49, 54, 149},   {69, 117, 180}, {171, 217, 233},
                                    {254, 224, 144}, {244, 109, 67}, {165, 0, 38}};
  t = std::clamp(t, 0.0, 1.0) * 5;
  const int i = std::min(4, static_cast<int>(t));
  const double u = t - i;
  int rgb[3];
  for (int k = 0; k < 3; ++k)
    rgb[k] = static_cast<int>(std::lround(stops[i][k] + (stops[i + 1][k] - stops[i][k]) * u));
  return fmt::format("#{:02x}{:02x}{:02x}", rgb[0], rgb[1], rgb[2]);
}

}  // namespace

std::string escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string format_number(double v) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  if (a >= 1e6 || a < 1e-3) return fmt::format("{:.2g}", v);
  if (a >= 1000) return fmt::format("{:.0f}", v);
  return fmt::format("{:.4g}", v);
}

std::string format_bytes(double v) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::abs(v) >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.3g} {}", v, units[u]);
}

std::string format_percent(double fraction) { return fmt::format("{:.3g}%", fraction * 100); }

Series thin_extremes(Series s, size_t max_points) {
  const size_t n = std::min(s.x.size(), s.y.size());
  if (n <= max_points || max_points < 4) return s;
  const size_t buckets = max_points / 2;
  std::vector<double> x, y;
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    size_t imin = lo, imax = lo;
    for (size_t i = lo; i < hi; ++i) {
      if (s.y[i] < s.y[imin]) imin = i;
      if (s.y[i] > s.y[imax]) imax = i;
    }
    for (size_t i : {std::min(imin, imax), std::max(imin, imax)}) {
      x.push_back(s.x[i]);
      y.push_back(s.y[i]);
      if (imin == imax) break;
    }
  }
  s.x = std::move(x);
  s.y = std::move(y);
  return s;
}

Series thin_mean(Series s, size_t max_points) {
  const size_t n = std::min(s.x.size(), s.y.size());
  if (n <= max_points || max_points < 1) return s;
  std::vector<double> x, y;
  for (size_t b = 0; b < max_points; ++b) {
    const size_t lo = b * n / max_points, hi = (b + 1) * n / max_points;
    double sx = 0, sy = 0;
    for (size_t i = lo; i < hi; ++i) {
      sx += s.x[i];
      sy += s.y[i];
    }
    x.push_back(sx / static_cast<double>(hi - lo));
    y.push_back(sy / static_cast<double>(hi - lo));
  }
  s.x = std::move(x);
  s.y = std::move(y);
  return s;
}

std::string line_chart(const Chart& c, const std::vector<Series>& series) {
  Range xr, yr;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
      if (std::isfinite(s.y[i])) {
        xr.add(s.x[i]);
        yr.add(s.y[i]);
      }
  if (xr.empty()) return empty_chart(c, "no records yet");
  if (c.y_from_zero) yr.add(0);
  double x0 = xr.lo, x1 = xr.hi, y0 = yr.lo, y1 = yr.hi;
  const auto xt = nice_ticks(x0, x1, 6);
  const auto yt = nice_ticks(y0, y1, 5);
  const Frame f{x0, x1, y0, y1, c.width, c.height};
  std::string s = open_svg(c) + axes(c, f, xt, yt, format_step);
  for (const auto& se : series) s += polyline(f, se);
  return s + legend(c, series) + close_svg();
}

std::string stacked_chart(const Chart& c, const std::vector<Series>& series) {
  if (series.empty() || series[0].x.empty()) return empty_chart(c, "no records yet");
  const auto& x = series[0].x;
  std::vector<double> base(x.size(), 0.0);
  std::vector<std::vector<double>> tops;
  for (const auto& s : series) {
    std::vector<double> top(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      top[i] = base[i] + (i < s.y.size() && std::isfinite(s.y[i]) ? std::max(0.0, s.y[i]) : 0.0);
    tops.push_back(top);
    base = top;
  }
  Range yr;
  yr.add(0);
  for (double v : base) yr.add(v);
  double x0 = x.front(), x1 = x.back(), y0 = 0, y1 = yr.hi;
  const auto xt = nice_ticks(x0, x1, 6);
  const auto yt = nice_ticks(y0, y1, 5);
  const Frame f{x0, x1, y0, y1, c.width, c.height};
  std::string s = open_svg(c) + axes(c, f, xt, yt, format_step);
  std::vector<double> below(x.size(), 0.0);
  for (size_t k = 0; k < series.size(); ++k) {
    std::string pts;
    // One step alone is drawn as a narrow band so it stays visible.
    const bool single = x.size() == 1;
    for (size_t i = 0; i < x.size(); ++i) {
      pts += fmt::format("{:.1f},{:.1f} ", f.px(x[i]) - (single ? 4 : 0), f.py(tops[k][i]));
      if (single) pts += fmt::format("{:.1f},{:.1f} ", f.px(x[i]) + 4, f.py(tops[k][i]));
    }
    for (size_t i = x.size(); i-- > 0;) {
      if (single) pts += fmt::format("{:.1f},{:.1f} ", f.px(x[i]) + 4, f.py(below[i]));
      pts += fmt::format("{:.1f},{:.1f} ", f.px(x[i]) - (single ? 4 : 0), f.py(below[i]));
    }
    s += fmt::format(
        "<polygon data-series=\"{}\" data-points=\"{}\" fill=\"{}\" fill-opacity=\"0.85\" "
        "stroke=\"{}\" stroke-width=\"0.5\" points=\"{}\"/>",
        escape(series[k].name), x.size(), series[k].color, series[k].color, pts);
    below = tops[k];
  }
  return s + legend(c, series, /*boxes=*/true) + close_svg();
}

std::string heat_map(const Chart& c, const HeatMap& m) {
  Range vr;
  for (const auto& row : m.cells)
    for (double v : row) vr.add(v);
  if (vr.empty() || m.column_steps.empty()) return empty_chart(c, "no per-rank records");
  const double legend_w = 70;
  const double x0 = kLeft, x1 = c.width - kRight - legend_w, y0 = kTop, y1 = c.height - kBottom;
  const size_t rows = m.cells.size(), cols = m.column_steps.size();
  const double cw = (x1 - x0) / static_cast<double>(cols),
               rh = (y1 - y0) / static_cast<double>(rows);
  const double span = vr.hi > vr.lo ? vr.hi - vr.lo : 1;
  std::string s = open_svg(c);
  s += fmt::format("<g data-series=\"rank_busy\" data-points=\"{}\" data-ranks=\"{}\">",
                   rows * cols, rows);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t k = 0; k < cols && k < m.cells[r].size(); ++k) {
      const double v = m.cells[r][k];
      const double first = k == 0 ? 1 : m.column_steps[k - 1] + 1;
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\">"
          "<title>{}, steps {:.0f}-{:.0f}: {}</title></rect>",
          x0 + k * cw, y0 + r * rh, cw + 0.3, rh - 1,
          std::isfinite(v) ? ramp((v - vr.lo) / span) : "#eeeeee", escape(m.row_labels[r]), first,
          m.column_steps[k], std::isfinite(v) ? fmt::format("{:.1f} ms", v * 1e3) : "no record");
    }
    s += fmt::format("<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>",
                     x0 - 6, y0 + (r + 0.5) * rh + 4, escape(m.row_labels[r]));
  }
  s += "</g>";
  // Step ticks under the columns.
  double lo = 1, hi = m.column_steps.back();
  for (double t : nice_ticks(lo, hi, 6)) {
    if (t < 1 || t > m.column_steps.back()) continue;
    const double x =
        x0 + (t - 1) / std::max(1.0, m.column_steps.back() - 1) * (x1 - x0 - cw) + cw / 2;
    s += fmt::format(
        "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>", x,
        y1 + 16, t);
  }
  s += fmt::format(
      "<text class=\"label\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
      (x0 + x1) / 2, c.height - 8, escape(c.x_label));
  // The colour scale.
  const double lx = c.width - kRight - legend_w + 16, lh = y1 - y0;
  for (int i = 0; i < 20; ++i)
    s += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"{:.2f}\" fill=\"{}\"/>",
                     lx, y0 + lh * i / 20.0, lh / 20.0 + 0.3, ramp(1 - i / 20.0));
  s += fmt::format(
      "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\">{:.1f} ms</text>"
      "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\">{:.1f} ms</text>",
      lx + 15, y0 + 8, vr.hi * 1e3, lx + 15, y1, vr.lo * 1e3);
  return s + close_svg();
}

std::string bar_chart(const Chart& c, const Bars& b) {
  Range yr;
  yr.add(0);
  for (const auto& s : b.series)
    for (double v : s.y) yr.add(v);
  for (const auto& l : b.lines)
    if (!l.y.empty()) yr.add(l.y[0]);
  if (b.groups.empty() || b.series.empty() || !(yr.hi > 0))
    return empty_chart(c, "no memory records");
  double y0 = 0, y1 = yr.hi;
  const auto yt = nice_ticks(y0, y1, 5);
  const Frame f{0, 1, y0, y1, c.width, c.height};
  std::string s = open_svg(c) + axes(c, f, {}, yt, format_step);
  const double gw = (c.width - kLeft - kRight) / static_cast<double>(b.groups.size());
  const double bw = std::min(40.0, gw * 0.7 / static_cast<double>(b.series.size()));
  for (size_t k = 0; k < b.series.size(); ++k) {
    const Series& se = b.series[k];
    s += fmt::format("<g data-series=\"{}\" data-points=\"{}\" fill=\"{}\">", escape(se.name),
                     std::min(se.y.size(), b.groups.size()), se.color);
    for (size_t g = 0; g < b.groups.size() && g < se.y.size(); ++g) {
      const double x = kLeft + gw * (g + 0.5) - bw * b.series.size() / 2 + bw * k;
      s += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\"><title>{} {}: "
          "{}</title></rect>",
          x, f.py(se.y[g]), bw - 2, f.py(0) - f.py(se.y[g]), escape(b.groups[g]),
          escape(se.label.empty() ? se.name : se.label), format_bytes(se.y[g]));
    }
    s += "</g>";
  }
  for (size_t g = 0; g < b.groups.size(); ++g)
    s += fmt::format(
        "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
        kLeft + gw * (g + 0.5), c.height - kBottom + 16, escape(b.groups[g]));
  std::vector<Series> keys = b.series;
  for (const auto& l : b.lines) {
    if (l.y.empty()) continue;
    s += fmt::format(
        "<line data-series=\"{}\" data-points=\"1\" x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" "
        "y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"2\" stroke-dasharray=\"6 4\"><title>{}: "
        "{}</title></line>",
        escape(l.name), kLeft, f.py(l.y[0]), c.width - kRight, f.py(l.y[0]), l.color,
        escape(l.label), format_bytes(l.y[0]));
    keys.push_back(l);
  }
  s += fmt::format(
      "<text class=\"label\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
      (kLeft + c.width - kRight) / 2, c.height - 8, escape(c.x_label));
  return s + legend(c, keys) + close_svg();
}

std::string timeline(const Chart& c, const std::vector<std::string>& rows,
                     const std::vector<std::string>& row_colors, const std::vector<Mark>& marks,
                     double max_step) {
  const double left = 130;
  double x0 = 0, x1 = std::max(1.0, max_step);
  const auto xt = nice_ticks(x0, x1, 8);
  const double w = c.width - left - kRight;
  const double rh =
      (c.height - kTop - kBottom) / static_cast<double>(std::max<size_t>(1, rows.size()));
  const auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * w; };
  std::string s = open_svg(c);
  for (double t : xt)
    s += fmt::format(
        "<line class=\"grid\" x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\"/>"
        "<text class=\"tick\" x=\"{0:.1f}\" y=\"{3:.1f}\" text-anchor=\"middle\">{4:.0f}</text>",
        px(t), kTop, c.height - kBottom, c.height - kBottom + 16, t);
  for (size_t r = 0; r < rows.size(); ++r) {
    const double y = kTop + (r + 0.5) * rh;
    int n = 0;
    std::string dots;
    for (const auto& m : marks)
      if (m.row == static_cast<int>(r)) {
        ++n;
        dots +=
            fmt::format("<path d=\"M{:.1f} {:.1f} l6 -7 l6 7 l-6 7 z\"><title>{}</title></path>",
                        px(m.step) - 6, y, escape(m.tip));
      }
    s += fmt::format(
        "<text class=\"tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>"
        "<line class=\"grid\" x1=\"{}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>"
        "<g data-series=\"timeline.{}\" data-points=\"{}\" fill=\"{}\">{}</g>",
        left - 8, y + 4, escape(rows[r]), left, y, c.width - kRight, y, escape(rows[r]), n,
        row_colors[r % row_colors.size()], dots);
  }
  s += fmt::format(
      "<text class=\"label\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>",
      left + w / 2, c.height - 8, escape(c.x_label));
  return s + close_svg();
}

}  // namespace ft::report
