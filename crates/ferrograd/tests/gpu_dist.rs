//! The NCCL group on one GPU (world size 1, the whole data-parallel path end to end): every
//! collective in every float dtype, CPU tensors staged through the GPU, errors for tensors of
//! another device or dtype, and a DDP step (buckets reduced on the communication stream while
//! backward goes on) equal to plain training. Needs a CUDA device and libnccl: without them
//! every test fails.
#![cfg(feature = "gpu-tests")]

use std::sync::Arc;

use ferrograd::dist::{Ddp, DdpConfig, NcclGroup, ProcessGroup, ReduceOp, nccl_unique_id};
use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);

fn group() -> Arc<NcclGroup> {
    let id = nccl_unique_id().expect("libnccl present");
    Arc::new(NcclGroup::new(0, 1, 0, id).expect("a communicator of one rank"))
}

fn filled(values: &[f64], dtype: DType, device: Device) -> Tensor {
    Tensor::from_vec_as(values.to_vec(), &[values.len()], DType::F64, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap()
}

fn read(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

#[test]
fn collectives_of_one_rank_in_every_float_dtype() {
    let g = group();
    assert_eq!((g.rank(), g.world_size(), g.backend_name()), (0, 1, "nccl"));
    let v = [1.0, -2.5, 3.0, 0.5];
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = filled(&v, dtype, GPU);
        g.all_reduce(&x, ReduceOp::Sum).unwrap();
        assert_eq!(read(&x), v, "{dtype} sum");
        g.all_reduce(&x, ReduceOp::Avg).unwrap();
        assert_eq!(read(&x), v, "{dtype} avg");
        g.broadcast(&x, 0).unwrap();
        assert_eq!(read(&x), v, "{dtype} broadcast");
        let out = Tensor::zeros(&[4], dtype, GPU).unwrap();
        g.reduce_scatter(&x, &out, ReduceOp::Sum).unwrap();
        assert_eq!(read(&out), v, "{dtype} reduce_scatter");
        let gathered = Tensor::zeros(&[4], dtype, GPU).unwrap();
        g.all_gather(&out, &gathered).unwrap();
        assert_eq!(read(&gathered), v, "{dtype} all_gather");
        g.all_reduce_launch(&x, ReduceOp::Sum).unwrap();
        g.wait_launched().unwrap();
        assert_eq!(read(&x), v, "{dtype} launched");
    }
    g.barrier().unwrap();
}

#[test]
fn cpu_tensors_are_staged_and_bad_buffers_refused() {
    let g = group();
    let loss = filled(&[2.25], DType::F64, Device::Cpu);
    g.all_reduce(&loss, ReduceOp::Avg).unwrap();
    assert_eq!(loss.to_vec::<f64>().unwrap(), [2.25]);
    let ints = Tensor::zeros(&[3], DType::I64, GPU).unwrap();
    let err = g.all_reduce(&ints, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("floating-point"), "{err}");
    let err = g
        .broadcast(&filled(&[1.0], DType::F32, GPU), 1)
        .unwrap_err();
    assert!(err.to_string().contains("root rank 1"), "{err}");
    let cpu_out = Tensor::zeros(&[4], DType::F32, Device::Cpu).unwrap();
    let err = g
        .reduce_scatter(&filled(&[1.0; 4], DType::F32, GPU), &cpu_out, ReduceOp::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("cpu"), "{err}");
    let err = NcclGroup::new(1, 1, 0, nccl_unique_id().unwrap())
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("rank 1 is not in a group of 1"),
        "{err}"
    );
}

fn mlp(seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    let mut lin = |i, o| Linear::new(i, o, true, GPU, &mut g).unwrap();
    Sequential::new()
        .push(lin(64, 256))
        .push(Relu)
        .push(lin(256, 64))
        .push(Relu)
        .push(lin(64, 8))
}

fn step(model: &dyn Module, finish: impl Fn()) -> Vec<Vec<f64>> {
    let mut opt = Sgd::new(
        model.parameters(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .unwrap();
    let mut rng = Generator::new(7);
    for _ in 0..3 {
        let x = Tensor::randn_with(&[32, 64], DType::F32, GPU, &mut rng).unwrap();
        let t = Tensor::randn_with(&[32, 8], DType::F32, GPU, &mut rng).unwrap();
        model
            .forward(&x)
            .unwrap()
            .mse_loss(&t)
            .unwrap()
            .backward()
            .unwrap();
        finish();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    }
    model.parameters().iter().map(read).collect()
}

#[test]
fn ddp_over_nccl_steps_as_one_process_does() {
    let plain = step(&mlp(3), || {});
    let cfg = DdpConfig {
        first_bucket_bytes: 4096,
        bucket_cap_bytes: 65_536,
        ..DdpConfig::default()
    };
    let ddp = Ddp::with_config(mlp(3), group(), cfg).unwrap();
    assert!(
        ddp.bucket_names().len() > 1,
        "several buckets overlap backward"
    );
    let wrapped = step(&ddp, || ddp.finish().unwrap());
    assert_eq!(wrapped, plain, "averaging over one rank changes nothing");
}
