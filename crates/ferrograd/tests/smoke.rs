use ferrograd::{Device, DType, Tensor, memory};

#[test]
fn demo_small() {
    let d = 4usize;
    let b = 3usize;
    let dev = Device::Cpu;
    let base = memory::memory_allocated(dev).unwrap();
    let w1 = Tensor::randn(&[d, d], DType::F32, dev).unwrap().requires_grad_(true).unwrap();
    let b1 = Tensor::randn(&[d], DType::F32, dev).unwrap().requires_grad_(true).unwrap();
    let w2 = Tensor::randn(&[d, d], DType::F32, dev).unwrap().requires_grad_(true).unwrap();
    let b2 = Tensor::randn(&[d], DType::F32, dev).unwrap().requires_grad_(true).unwrap();
    let x = Tensor::randn(&[b, d], DType::F32, dev).unwrap();
    let out = x.linear(&w1, Some(&b1)).unwrap().relu().unwrap().linear(&w2, Some(&b2)).unwrap();
    let before = memory::memory_allocated(dev).unwrap() - base;
    println!("{}", memory::memory_summary(dev).unwrap());
    out.sum_all().unwrap().backward().unwrap();
    let after = memory::memory_allocated(dev).unwrap() - base;
    let p = (2 * d * d + 2 * d) * 4;
    assert_eq!(before as usize, p + b * d * 4 * 3);
    assert_eq!(after as usize, 2 * p + b * d * 4 * 2);
    println!("{:?}", w1.grad());
}
