//! The networks the fused step-in-backward tests run (CPU and GPU): how the parameters
//! [w1, b1, w2, b2] are used by the loss, the batch they see and the SGD momentum settings.
#![allow(dead_code)]

use ferrograd::optim::SgdConfig;
use ferrograd::{DType, Device, Generator, Tensor};

/// A batch (x, y), both (b, d), drawn on the CPU in `dtype` and moved to `device`: every
/// device sees the same values.
pub fn data_as(b: usize, d: usize, dtype: DType, device: Device) -> (Tensor, Tensor) {
    let mut g = Generator::new(1);
    let mut draw = || {
        Tensor::randn_with(&[b, d], dtype, Device::Cpu, &mut g)
            .unwrap()
            .to_device(device)
            .unwrap_or_else(|e| panic!("cannot move the batch to {device}: {e}"))
    };
    (draw(), draw())
}

/// SGD with momentum 0.9: the optimizer whose step fuses into the weight-gradient GEMMs.
pub fn momentum_cfg() -> SgdConfig {
    SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    }
}

/// How the parameters are used: the MLP; w1 twice in one forward; the MLP with an extra
/// non-linear use of w2 (an L2 term), whose gradient arrives as an ordinary `.grad`.
#[derive(Clone, Copy, Debug)]
pub enum Net {
    Mlp,
    SharedWeight,
    MixedUse,
}

pub fn loss_of(net: Net, p: &[Tensor], x: &Tensor, y: &Tensor) -> Tensor {
    let h = x.linear(&p[0], Some(&p[1])).unwrap().relu().unwrap();
    let h = match net {
        Net::SharedWeight => h.linear(&p[0], None).unwrap().relu().unwrap(),
        _ => h,
    };
    let loss = h.linear(&p[2], Some(&p[3])).unwrap().mse_loss(y).unwrap();
    match net {
        Net::MixedUse => loss
            .add(
                &p[2]
                    .mul(&p[2])
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .mul_scalar(1e-2)
                    .unwrap(),
            )
            .unwrap(),
        _ => loss,
    }
}
