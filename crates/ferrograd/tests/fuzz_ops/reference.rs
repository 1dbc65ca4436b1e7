//! A plain f64 model of the ops the fuzz target chains: row-major data and a shape, each op
//! written the obvious way (no views, no strides, no dtypes), to serve as the reference the
//! library's results are compared against.

#[derive(Clone, Debug)]
pub struct Nd {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// The multi-index of row-major position `i`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// The shape two shapes broadcast to, or None.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| {
        if i + s.len() >= rank {
            s[i + s.len() - rank]
        } else {
            1
        }
    };
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Some(x),
            (1, y) => Some(y),
            (x, 1) => Some(x),
            _ => None,
        })
        .collect()
}

impl Nd {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Nd {
        assert_eq!(numel(shape), data.len());
        Nd {
            shape: shape.to_vec(),
            data,
        }
    }

    /// A tensor of `shape` whose element at each index is `f(index)`.
    fn build(shape: &[usize], f: impl Fn(&[usize]) -> f64) -> Nd {
        let data = (0..numel(shape)).map(|i| f(&unravel(i, shape))).collect();
        Nd::new(shape, data)
    }

    fn at(&self, idx: &[usize]) -> f64 {
        self.data[ravel(idx, &self.shape)]
    }

    pub fn map(&self, f: impl Fn(f64) -> f64) -> Nd {
        Nd::new(&self.shape, self.data.iter().map(|&x| f(x)).collect())
    }

    pub fn broadcast_to(&self, shape: &[usize]) -> Nd {
        let lead = shape.len() - self.shape.len();
        Nd::build(shape, |idx| {
            let own: Vec<usize> = idx[lead..]
                .iter()
                .zip(&self.shape)
                .map(|(&i, &n)| if n == 1 { 0 } else { i })
                .collect();
            self.at(&own)
        })
    }

    pub fn zip(&self, other: &Nd, f: impl Fn(f64, f64) -> f64) -> Option<Nd> {
        let shape = broadcast(&self.shape, &other.shape)?;
        let (a, b) = (self.broadcast_to(&shape), other.broadcast_to(&shape));
        Some(Nd::new(
            &shape,
            a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect(),
        ))
    }

    fn kept(&self, dims: &[usize], keepdim: bool) -> Vec<usize> {
        (0..self.shape.len())
            .filter_map(|d| match (dims.contains(&d), keepdim) {
                (false, _) => Some(self.shape[d]),
                (true, true) => Some(1),
                (true, false) => None,
            })
            .collect()
    }

    /// Folds the elements of `dims` into each output (dims kept as 1, then dropped unless
    /// `keepdim`).
    fn reduce(&self, dims: &[usize], keepdim: bool, f: impl Fn(&[f64]) -> f64) -> Nd {
        let kept_shape = self.kept(dims, true);
        let mut groups = vec![Vec::new(); numel(&kept_shape)];
        for i in 0..self.data.len() {
            let mut idx = unravel(i, &self.shape);
            dims.iter().for_each(|&d| idx[d] = 0);
            groups[ravel(&idx, &kept_shape)].push(self.data[i]);
        }
        Nd::new(
            &self.kept(dims, keepdim),
            groups.iter().map(|g| f(g)).collect(),
        )
    }

    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Nd {
        self.reduce(dims, keepdim, |g| g.iter().sum())
    }

    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Nd {
        self.reduce(dims, keepdim, |g| g.iter().sum::<f64>() / g.len() as f64)
    }

    /// Max over one dim, NaN winning (PyTorch).
    pub fn max(&self, dim: usize, keepdim: bool) -> Nd {
        self.reduce(&[dim], keepdim, |g| {
            g.iter().fold(f64::NEG_INFINITY, |m, &v| {
                if m.is_nan() || v.is_nan() {
                    f64::NAN
                } else {
                    m.max(v)
                }
            })
        })
    }

    pub fn transpose(&self, a: usize, b: usize) -> Nd {
        let mut shape = self.shape.clone();
        shape.swap(a, b);
        Nd::build(&shape, |idx| {
            let mut src = idx.to_vec();
            src.swap(a, b);
            self.at(&src)
        })
    }

    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Nd {
        let mut shape = self.shape.clone();
        shape[dim] = len;
        Nd::build(&shape, |idx| {
            let mut src = idx.to_vec();
            src[dim] += start;
            self.at(&src)
        })
    }

    pub fn reshape(&self, shape: &[usize]) -> Nd {
        Nd::new(shape, self.data.clone())
    }

    /// Softmax (or log-softmax) along `dim`.
    pub fn softmax(&self, dim: usize, log: bool) -> Nd {
        let max = self.reduce(&[dim], true, |g| {
            g.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
        });
        let shifted = self.zip(&max, |x, m| x - m).unwrap();
        let lse = shifted.reduce(&[dim], true, |g| {
            g.iter().map(|x| x.exp()).sum::<f64>().ln()
        });
        let log_p = shifted.zip(&lse, |x, l| x - l).unwrap();
        if log { log_p } else { log_p.map(f64::exp) }
    }

    /// Layer norm over the last dim, no affine.
    pub fn layer_norm_last(&self, eps: f64) -> Nd {
        let last = self.shape.len() - 1;
        let mean = self.mean(&[last], true);
        let centered = self.zip(&mean, |x, m| x - m).unwrap();
        let var = centered.map(|x| x * x).mean(&[last], true);
        centered.zip(&var, |x, v| x / (v + eps).sqrt()).unwrap()
    }

    /// (m, k) @ (k, n).
    pub fn matmul(&self, other: &Nd) -> Nd {
        let (m, k, n) = (self.shape[0], self.shape[1], other.shape[1]);
        Nd::build(&[m, n], |idx| {
            (0..k)
                .map(|p| self.at(&[idx[0], p]) * other.at(&[p, idx[1]]))
                .sum()
        })
    }
}
