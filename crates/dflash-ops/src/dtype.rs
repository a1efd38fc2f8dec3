//! Element types a [`Buffer`](crate::Buffer) can hold.

use half::{bf16, f16};

/// The storage type of a buffer's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16 (1 sign, 8 exponent, 7 mantissa bits).
    BF16,
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
    /// Signed 32-bit integer (token ids, positions, counts, indices).
    I32,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
        })
    }
}

#[cfg(feature = "cuda")]
mod sealed {
    /// Device-side requirements of an element (cudarc's traits) when CUDA is compiled in.
    pub trait DeviceElem: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
    impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceElem for T {}
}
#[cfg(not(feature = "cuda"))]
mod sealed {
    /// No device-side requirements without CUDA.
    pub trait DeviceElem {}
    impl<T> DeviceElem for T {}
}

/// A type that can live in a [`Buffer`](crate::Buffer): one of bf16, f16, f32, i32.
pub trait Element:
    bytemuck::Pod
    + Copy
    + Default
    + PartialEq
    + Send
    + Sync
    + std::fmt::Debug
    + sealed::DeviceElem
    + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// The bit pattern written into outputs before a checked run (a value no op produces
    /// by accident: a signalling-style NaN for floats, `i32::MIN` for integers).
    const POISON: Self;
    /// Widen to f64 (exact for every element type).
    fn to_f64(self) -> f64;
    /// The raw bits, widened to u32, for exact comparisons.
    fn bits(self) -> u32;
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    const POISON: Self = bf16::from_bits(0x7fa5);
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    const POISON: Self = f16::from_bits(0x7da5);
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const POISON: Self = f32::from_bits(0x7fa5_a5a5);
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    const POISON: Self = i32::MIN;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn bits(self) -> u32 {
        self as u32
    }
}

/// Round an f32 to bf16, round-to-nearest-even (the only bf16 cast the contracts use).
#[inline]
pub fn bf16_rne(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// Round an f64 to bf16 ONCE, round-to-nearest-even on the exact f64 value.
///
/// This is the rounding of every f64 oracle in this crate. (`half::bf16::from_f64` truncates
/// the low mantissa word first and can misround a value just above a tie.) It goes through f32
/// with round-to-odd, which is exact for a final 8-bit significand because f32 keeps at least
/// 8 + 2 bits more, also in the subnormal range (bf16 and f32 share the exponent range).
pub fn bf16_rne_f64(x: f64) -> bf16 {
    let f = x as f32; // RNE to f32
    if x.is_nan() || f.is_infinite() || f64::from(f) == x {
        return bf16::from_f32(f);
    }
    // Round to odd: the f32 neighbour toward zero, with its lowest bit forced to 1.
    let mut bits = f.to_bits();
    if f64::from(f).abs() > x.abs() {
        bits -= 1; // one f32 ulp toward zero (same sign; f != 0 here)
    }
    bf16::from_f32(f32::from_bits(bits | 1))
}

/// Round an f32 to f16, round-to-nearest-even.
#[inline]
pub fn f16_rne(x: f32) -> f16 {
    f16::from_f32(x)
}
