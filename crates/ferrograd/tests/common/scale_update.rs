//! The loss scale's update on a device (`backend::optim::update_scale`) against the host's
//! rule (`next_scale`), shared by the CPU test and the GPU one.

use ferrograd::backend::View;
use ferrograd::backend::optim::{UpdateScale, next_scale, update_scale};
use ferrograd::{DType, Device, Tensor};

/// Every branch of the rule on `device`: backoff, counting, growth, growth that would
/// overflow f32, a subnormal backoff; with the default factors and odd ones (the f32 · f64
/// product rounded once), and the layout of state and report.
pub fn check_scale_update(device: Device) {
    let cases: [(f32, u64, bool); 7] = [
        (65536.0, 0, true),
        (65536.0, 5, false),
        (65536.0, 6, false),
        (f32::MAX, 6, false),
        (3.0e-38, 2, true),
        (1.5, 0, false),
        (12345.678, 6, false),
    ];
    for factors in [(2.0, 0.5, 7), (1.1, 0.3, 7)] {
        for (scale, tracker, found) in cases {
            let state = Tensor::from_vec(vec![scale, 0.0, tracker as f32], &[3], device).unwrap();
            let report = Tensor::zeros(&[2], DType::F32, device).unwrap();
            let flag = Tensor::from_vec(vec![found as u8 as f32], &[1], device).unwrap();
            update_scale(&UpdateScale {
                found_inf: View {
                    storage: flag.storage(),
                    layout: flag.layout(),
                },
                state: state.storage(),
                report: Some(report.storage()),
                growth_factor: factors.0,
                backoff_factor: factors.1,
                growth_interval: factors.2,
            })
            .unwrap();
            let (want, want_tracker) = next_scale((scale, tracker), found, factors);
            let inv = (1.0 / want as f64) as f32;
            let case = format!("{scale} {tracker} {found} {factors:?}");
            let got = state.to_vec::<f32>().unwrap();
            assert_eq!(got, vec![want, inv, want_tracker as f32], "{case}");
            let r = report.to_vec::<f32>().unwrap();
            assert_eq!(r, vec![found as u8 as f32, want], "{case}");
        }
    }
}
