use ferrograd::*;
fn p<T: std::fmt::Debug>(name: &str, f: impl FnOnce() -> T + std::panic::UnwindSafe) {
    match std::panic::catch_unwind(f) {
        Ok(v) => println!("{name}: {v:?}"),
        Err(e) => println!("{name}: PANIC {:?}", e.downcast_ref::<String>()),
    }
}
#[test]
fn probe() {
    let cpu = Device::Cpu;
    p("sum dim0 of 0-dim", || {
        Tensor::scalar(2.0, DType::F32, cpu)
            .unwrap()
            .sum(&[0], false)
            .map(|t| t.to_vec::<f32>())
    });
    p("max_dim of 0-dim", || {
        Tensor::scalar(2.0, DType::F32, cpu)
            .unwrap()
            .max_dim(0, false)
            .map(|t| t.0.to_vec::<f32>())
    });
    p("mean dim -1 of 0-dim", || {
        Tensor::scalar(2.0, DType::F32, cpu)
            .unwrap()
            .mean(&[-1], false)
            .map(|t| t.to_vec::<f32>())
    });
    p("grad dtype mismatch", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let r = x.mul_scalar(2.0).unwrap().backward_with(BackwardOptions {
            gradient: Some(Tensor::ones(&[2], DType::F64, cpu).unwrap()),
            retain_graph: false,
        });
        (r.map_err(|e| e.to_string()), x.grad().map(|g| g.dtype()))
    });
    p("leaf grad dtype mismatch", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let r = x.backward_with(BackwardOptions {
            gradient: Some(Tensor::ones(&[2], DType::F64, cpu).unwrap()),
            retain_graph: false,
        });
        (r.map_err(|e| e.to_string()), x.grad().map(|g| g.dtype()))
    });
    p("set_grad dtype", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        x.set_grad(Some(Tensor::ones(&[2], DType::F64, cpu).unwrap()))
            .map_err(|e| e.to_string())
    });
    p("sum twice no retain", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let y = x.sum_all().unwrap();
        y.backward().unwrap();
        y.backward().map_err(|e| e.to_string())
    });
    p("hook on dropped non-leaf", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let y = x.mul_scalar(1.0).unwrap();
        y.register_hook(|g| Ok(Some(g.mul_scalar(100.0)?)));
        let z = y.mul_scalar(1.0).unwrap();
        drop(y);
        z.sum_all().unwrap().backward().unwrap();
        x.grad().unwrap().to_vec::<f32>()
    });
    p("rayon sum determinism", || {
        let mut g = Generator::new(1);
        let x = Tensor::randn_with(&[1 << 22], DType::F64, cpu, &mut g).unwrap();
        let first = x.sum_all().unwrap().item().unwrap();
        let mut diff = 0;
        for _ in 0..100 {
            if x.sum_all().unwrap().item().unwrap().to_bits() != first.to_bits() {
                diff += 1;
            }
        }
        diff
    });
    p("matmul k=0", || {
        Tensor::zeros(&[2, 0], DType::F32, cpu)
            .unwrap()
            .matmul(&Tensor::zeros(&[0, 3], DType::F32, cpu).unwrap())
            .map(|t| t.to_vec::<f32>())
    });
    p("narrow len0 backward", || {
        let x = Tensor::ones(&[2, 3], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        x.narrow(1, 1, 0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .map(|_| x.grad().unwrap().to_vec::<f32>())
    });
    p("sum of empty", || {
        Tensor::zeros(&[0, 3], DType::F32, cpu)
            .unwrap()
            .sum(&[0], false)
            .map(|t| t.to_vec::<f32>())
    });
    p("max of (2,0) over dim 0", || {
        Tensor::zeros(&[2, 0], DType::F32, cpu)
            .unwrap()
            .max_dim(0, false)
            .map(|t| t.0.shape().to_vec())
    });
    p("expand 0-dim", || {
        let x = Tensor::scalar(2.0, DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        x.expand(&[2, 3])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .map(|_| x.grad().unwrap().to_vec::<f32>())
    });
    p("pow a=0 b=2 grad", || {
        let a = Tensor::from_vec(vec![0.0f32], &[1], cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let b = Tensor::from_vec(vec![2.0f32], &[1], cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        a.pow(&b).unwrap().backward().unwrap();
        (
            a.grad().unwrap().to_vec::<f32>(),
            b.grad().unwrap().to_vec::<f32>(),
        )
    });
    p("sqrt at 0 grad", || {
        let a = Tensor::from_vec(vec![0.0f32], &[1], cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        a.sqrt().unwrap().backward().unwrap();
        a.grad().unwrap().to_vec::<f32>()
    });
    p("relu at 0 grad", || {
        let a = Tensor::from_vec(vec![0.0f32], &[1], cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        a.relu().unwrap().backward().unwrap();
        a.grad().unwrap().to_vec::<f32>()
    });
    p("matmul 1d@1d", || {
        let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2], cpu).unwrap();
        a.matmul(&a)
            .map(|t| (t.shape().to_vec(), t.to_vec::<f32>()))
    });
    p("squeeze noncontig", || {
        let a = Tensor::arange(0.0, 6.0, 1.0, DType::F32, cpu)
            .unwrap()
            .reshape(&[3, 1, 2])
            .unwrap()
            .permute(&[2, 1, 0])
            .unwrap();
        a.squeeze(1)
            .map(|t| (t.shape().to_vec(), t.to_vec::<f32>()))
    });
    p("unsqueeze noncontig", || {
        let a = Tensor::arange(0.0, 6.0, 1.0, DType::F32, cpu)
            .unwrap()
            .reshape(&[3, 2])
            .unwrap()
            .t()
            .unwrap();
        a.unsqueeze(2)
            .map(|t| (t.shape().to_vec(), t.strides().to_vec(), t.to_vec::<f32>()))
    });
    p("unsqueeze noncontig at 0 then matmul", || {
        let a = Tensor::arange(0.0, 6.0, 1.0, DType::F32, cpu)
            .unwrap()
            .reshape(&[3, 2])
            .unwrap()
            .t()
            .unwrap();
        let b = a.unsqueeze(0).unwrap();
        (
            b.shape().to_vec(),
            b.strides().to_vec(),
            b.to_vec::<f32>().unwrap(),
        )
    });
    p("retain_grad no req", || {
        let a = Tensor::ones(&[1], DType::F32, cpu).unwrap();
        a.retain_grad();
        a.requires_grad()
    });
    p("to_dtype grad", || {
        let x = Tensor::ones(&[2], DType::F32, cpu)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        x.to_dtype(DType::F64)
            .unwrap()
            .mul_scalar(3.0)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        (x.grad().unwrap().dtype(), x.grad().unwrap().to_vec::<f32>())
    });
}
