//! A self-contained HTML report of one device's timeline: memory stacked by category over
//! time with reserved memory beside it, the phases as bands behind, the peak marked with its
//! breakdown and its largest live blocks (op, module, call site). Inline SVG and a few lines
//! of inline script (a cursor that reads the values under the mouse); nothing is fetched.

use std::fmt::Write;

use super::timeline::{LiveBlock, Sample, Timeline};
use crate::base::{Category, format_size};
use crate::memory::recorder::{Phase, Recording};

const W: f64 = 1000.0;
const H: f64 = 360.0;
const LEFT: f64 = 80.0;
const TOP: f64 = 24.0;
const PLOT_W: f64 = W - LEFT - 20.0;
const PLOT_H: f64 = H - TOP - 40.0;
/// Most samples drawn; longer timelines keep each bucket's highest sample.
const MAX_POINTS: usize = 1500;

fn colour(c: Category) -> &'static str {
    match c {
        Category::Parameter => "#4e79a7",
        Category::Gradient => "#f28e2b",
        Category::SavedActivation => "#e15759",
        Category::OptimizerState => "#76b7b2",
        Category::Input => "#59a14f",
        Category::Workspace => "#edc948",
        Category::Temporary => "#b07aa1",
    }
}

fn phase_colour(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "#dbe9f6",
        Phase::Backward => "#fde2cf",
        Phase::Optimizer => "#d9f0d3",
        Phase::Evaluation => "#eee0f5",
        Phase::Other => "#ffffff",
    }
}

/// Escapes text for HTML and SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn downsample(samples: &[Sample]) -> Vec<Sample> {
    if samples.len() <= MAX_POINTS {
        return samples.to_vec();
    }
    let per = samples.len().div_ceil(MAX_POINTS);
    samples
        .chunks(per)
        .filter_map(|c| c.iter().max_by_key(|s| s.allocated()).copied())
        .collect()
}

struct Scale {
    t0: u64,
    span: f64,
    top: f64,
}

impl Scale {
    fn x(&self, ns: u64) -> f64 {
        LEFT + (ns.saturating_sub(self.t0)) as f64 / self.span * PLOT_W
    }
    fn y(&self, bytes: u64) -> f64 {
        TOP + PLOT_H - bytes as f64 / self.top * PLOT_H
    }
}

/// The report page for `t`, with `rec`'s summary line.
pub fn html_report(rec: &Recording, t: &Timeline) -> String {
    let mut page = String::new();
    let _ = writeln!(
        page,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>ferrograd memory: {dev}</title>\n<style>{CSS}</style></head><body>\n<h1>Memory over time on {dev}</h1>\n<p class=\"summary\">{summary}</p>",
        dev = t.device,
        summary = esc(&rec.summary())
    );
    if t.samples.len() <= 1 && rec.events.is_empty() {
        page += "<p>Nothing was recorded.</p>\n</body></html>\n";
        return page;
    }
    page += &chart(rec, t);
    page += &peak_tables(rec, t);
    page += SCRIPT;
    page += "</body></html>\n";
    page
}

fn chart(rec: &Recording, t: &Timeline) -> String {
    let samples = downsample(&t.samples);
    let t0 = samples.first().map_or(0, |s| s.time_ns);
    let end = samples
        .last()
        .map_or(t0, |s| s.time_ns)
        .max(t.duration_ns)
        .max(t0 + 1);
    let top = samples
        .iter()
        .map(|s| s.allocated().max(s.reserved))
        .max()
        .unwrap_or(0)
        .max(1);
    let sc = Scale {
        t0,
        span: (end - t0) as f64,
        top: top as f64 * 1.05,
    };
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        "<svg id=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\">"
    );
    svg += &phase_bands(t, &sc);
    svg += &stacked_areas(&samples, &sc);
    svg += &reserved_line(&samples, &sc);
    svg += &axes(&sc, end);
    svg += &peak_marker(t, &sc);
    svg += "<line id=\"cursor\" x1=\"0\" x2=\"0\" y1=\"24\" y2=\"320\" stroke=\"#333\" stroke-width=\"0.5\" visibility=\"hidden\"/>\n</svg>\n";
    let data: Vec<String> = samples
        .iter()
        .map(|s| format!("[{},{},{}]", s.time_ns, s.allocated(), s.reserved))
        .collect();
    let mut out = format!(
        "{svg}<p id=\"readout\">&#160;</p>\n{}\n<script>const SAMPLES=[{}];const SCALE={{t0:{t0},span:{},left:{LEFT},width:{PLOT_W}}};</script>\n",
        legend(),
        data.join(","),
        sc.span
    );
    let _ = writeln!(
        out,
        "<p class=\"note\">Time runs from the first kept event ({:.3} ms recorded). Bands: phases of the step. Dashed line: reserved memory.</p>",
        rec.duration_ns as f64 / 1e6
    );
    out
}

fn phase_bands(t: &Timeline, sc: &Scale) -> String {
    let mut svg = String::from("<g class=\"phases\">\n");
    for p in t.phases.iter().filter(|p| p.phase != Phase::Other) {
        let (x0, x1) = (sc.x(p.start_ns), sc.x(p.end_ns));
        let _ = writeln!(
            svg,
            "<rect class=\"phase\" data-phase=\"{name}\" x=\"{x0:.2}\" y=\"{TOP}\" width=\"{w:.2}\" height=\"{PLOT_H}\" fill=\"{fill}\"><title>{name}, step {step}</title></rect>",
            name = p.phase.name(),
            w = (x1 - x0).max(0.5),
            fill = phase_colour(p.phase),
            step = p.step
        );
        if x1 - x0 > 40.0 {
            let _ = writeln!(
                svg,
                "<text x=\"{:.2}\" y=\"{}\" class=\"band\">{} {}</text>",
                x0 + 3.0,
                TOP + 12.0,
                p.phase.name(),
                p.step
            );
        }
    }
    svg + "</g>\n"
}

/// The outline of `value` over `samples` as steps: memory holds its level until the next
/// event, so each sample's value starts at its own time.
fn steps(samples: &[Sample], sc: &Scale, value: impl Fn(usize) -> u64) -> Vec<String> {
    let mut pts = Vec::with_capacity(2 * samples.len());
    for (i, s) in samples.iter().enumerate() {
        let x = sc.x(s.time_ns);
        if i > 0 {
            pts.push(format!("{x:.2},{:.2}", sc.y(value(i - 1))));
        }
        pts.push(format!("{x:.2},{:.2}", sc.y(value(i))));
    }
    pts
}

fn stacked_areas(samples: &[Sample], sc: &Scale) -> String {
    let mut svg = String::from("<g class=\"areas\">\n");
    let mut below = vec![0u64; samples.len()];
    for c in Category::ALL {
        let above: Vec<u64> = samples
            .iter()
            .zip(&below)
            .map(|(s, b)| b + s.by_category.get(c))
            .collect();
        if above != below {
            let mut pts = steps(samples, sc, |i| above[i]);
            let mut under = steps(samples, sc, |i| below[i]);
            under.reverse();
            pts.extend(under);
            let _ = writeln!(
                svg,
                "<polygon class=\"area\" data-category=\"{}\" fill=\"{}\" points=\"{}\"/>",
                c.name(),
                colour(c),
                pts.join(" ")
            );
        }
        below = above;
    }
    svg + "</g>\n"
}

fn reserved_line(samples: &[Sample], sc: &Scale) -> String {
    let pts = steps(samples, sc, |i| samples[i].reserved);
    format!(
        "<polyline class=\"reserved\" fill=\"none\" stroke=\"#222\" stroke-dasharray=\"4 3\" points=\"{}\"/>\n",
        pts.join(" ")
    )
}

fn axes(sc: &Scale, end: u64) -> String {
    let mut svg = format!(
        "<g class=\"axes\"><line x1=\"{LEFT}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"#000\"/><line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{b}\" stroke=\"#000\"/>\n",
        b = TOP + PLOT_H,
        r = LEFT + PLOT_W
    );
    for i in 0..=4 {
        let bytes = (sc.top * i as f64 / 4.0) as u64;
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{:.2}\" text-anchor=\"end\">{}</text>",
            LEFT - 4.0,
            sc.y(bytes) + 4.0,
            format_size(bytes)
        );
        let ns = sc.t0 + ((end - sc.t0) as f64 * i as f64 / 4.0) as u64;
        let _ = writeln!(
            svg,
            "<text x=\"{:.2}\" y=\"{}\" text-anchor=\"{}\">{:.1} ms</text>",
            sc.x(ns),
            TOP + PLOT_H + 16.0,
            // The last label ends at the axis' end rather than running off the picture.
            if i == 4 { "end" } else { "middle" },
            (ns - sc.t0) as f64 / 1e6
        );
    }
    svg + "</g>\n"
}

fn peak_marker(t: &Timeline, sc: &Scale) -> String {
    let x = sc.x(t.peak.sample.time_ns);
    let y = sc.y(t.peak.sample.allocated());
    format!(
        "<g class=\"peak\"><line x1=\"{x:.2}\" y1=\"{TOP}\" x2=\"{x:.2}\" y2=\"{b}\" stroke=\"#c00\"/><circle cx=\"{x:.2}\" cy=\"{y:.2}\" r=\"4\" fill=\"#c00\"/><text x=\"{tx:.2}\" y=\"{ty:.2}\" fill=\"#c00\">peak {size}</text></g>\n",
        b = TOP + PLOT_H,
        tx = (x + 6.0).min(W - 120.0),
        ty = (y - 6.0).max(TOP + 24.0),
        size = format_size(t.peak.sample.allocated())
    )
}

fn legend() -> String {
    let mut s = String::from("<p class=\"legend\">");
    for c in Category::ALL {
        let _ = write!(
            s,
            "<span><i style=\"background:{}\"></i>{}</span> ",
            colour(c),
            c.name()
        );
    }
    s + "<span><i class=\"dash\"></i>reserved</span></p>"
}

fn peak_tables(rec: &Recording, t: &Timeline) -> String {
    let p = &t.peak.sample;
    let mut s = format!(
        "<h2>At the peak: {} allocated, {} reserved</h2>\n<table id=\"breakdown\"><tr><th>category</th><th>bytes</th><th>share</th></tr>\n",
        format_size(p.allocated()),
        format_size(p.reserved)
    );
    for (c, bytes) in p.by_category.iter().filter(|(_, b)| *b > 0) {
        let _ = writeln!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{:.1}%</td></tr>",
            c.name(),
            format_size(bytes),
            100.0 * bytes as f64 / p.allocated().max(1) as f64
        );
    }
    s += "</table>\n<h2>Largest blocks alive at the peak</h2>\n<table id=\"largest\"><tr><th>size</th><th>category</th><th>op</th><th>module</th><th>call site</th></tr>\n";
    for b in &t.peak.largest {
        s += &block_row(rec, b);
    }
    s + "</table>\n"
}

fn block_row(rec: &Recording, b: &LiveBlock) -> String {
    let site = b
        .origin
        .site
        .map_or(String::new(), |l| format!("{}:{}", l.file(), l.line()));
    format!(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        format_size(b.size),
        b.category.name(),
        esc(b.origin.op),
        esc(rec.module_name(b.origin.module)),
        esc(&site)
    )
}

const CSS: &str = "body{font-family:sans-serif;margin:20px;color:#222}svg text{font-size:11px}\
text.band{fill:#555}table{border-collapse:collapse;margin-bottom:16px}\
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}\
.legend span{margin-right:12px}.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}\
.legend i.dash{border-top:2px dashed #222;height:0}.summary,.note{color:#555}";

const SCRIPT: &str = "<script>\n(function(){const svg=document.getElementById('chart');if(!svg||!SAMPLES.length)return;\
const cur=document.getElementById('cursor'),out=document.getElementById('readout');\
const fmt=b=>b>=1048576?(b/1048576).toFixed(2)+' MiB':(b/1024).toFixed(1)+' KiB';\
svg.addEventListener('mousemove',e=>{const r=svg.getBoundingClientRect();const x=(e.clientX-r.left)*svg.viewBox.baseVal.width/r.width;\
const t=SCALE.t0+(x-SCALE.left)/SCALE.width*SCALE.span;let s=SAMPLES[0];for(const v of SAMPLES){if(v[0]<=t)s=v;else break;}\
cur.setAttribute('x1',x);cur.setAttribute('x2',x);cur.setAttribute('visibility','visible');\
out.textContent=((t-SCALE.t0)/1e6).toFixed(3)+' ms: '+fmt(s[1])+' allocated, '+fmt(s[2])+' reserved';});})();\n</script>\n";
