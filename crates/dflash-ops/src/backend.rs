//! The backend interface: where buffers live and where ops run.
//!
//! [`Backend::Cpu`] runs every op's plain reference (the contract evaluated on the host);
//! `Backend::Cuda` (feature `cuda`) runs the NVRTC kernels and cuBLAS. Buffers are typed
//! ([`Element`]: bf16, f16, f32, i32), flat, and belong to the backend that made them; an op
//! refuses a buffer from another backend with [`OpsError::WrongBackend`].
//!
//! Ops are free functions `op::run(&Backend, inputs.., outputs.., &Params)`: they validate every
//! shape and parameter before touching an output, so a refused call leaves all outputs as they
//! were.

use crate::{Element, OpsError, Result};

/// Which implementation runs the ops.
#[derive(Clone, Debug, Default)]
pub enum Backend {
    /// The host reference implementation (always available).
    #[default]
    Cpu,
    /// An NVIDIA GPU through cudarc (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBackend),
}

/// Storage of a [`Buffer`].
#[derive(Debug)]
pub(crate) enum Storage<T: Element> {
    /// Host memory.
    Host(Vec<T>),
    /// Device memory and the logical length (an empty buffer holds a 1-element allocation,
    /// since the driver refuses zero-byte allocations).
    #[cfg(feature = "cuda")]
    Device(cudarc::driver::CudaSlice<T>, usize),
}

/// A flat, typed array owned by one backend.
#[derive(Debug)]
pub struct Buffer<T: Element> {
    pub(crate) storage: Storage<T>,
}

impl<T: Element> Buffer<T> {
    /// A host buffer holding `data` (the CPU backend's buffers are exactly these).
    pub fn from_vec(data: Vec<T>) -> Self {
        Buffer {
            storage: Storage::Host(data),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.storage {
            Storage::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Storage::Device(_, len) => *len,
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The name of the backend the buffer lives on (`"cpu"` or `"cuda"`).
    pub fn backend_name(&self) -> &'static str {
        match &self.storage {
            Storage::Host(_) => "cpu",
            #[cfg(feature = "cuda")]
            Storage::Device(..) => "cuda",
        }
    }

    /// The host elements, or [`OpsError::WrongBackend`] for a device buffer.
    pub fn host(&self, op: &'static str, tensor: &'static str) -> Result<&[T]> {
        let _ = (op, tensor); // used only when a device variant exists
        match &self.storage {
            Storage::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Device(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cpu",
                found: "cuda",
            }),
        }
    }

    /// The host elements, mutable, or [`OpsError::WrongBackend`] for a device buffer.
    pub fn host_mut(&mut self, op: &'static str, tensor: &'static str) -> Result<&mut [T]> {
        let _ = (op, tensor); // used only when a device variant exists
        match &mut self.storage {
            Storage::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Storage::Device(..) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cpu",
                found: "cuda",
            }),
        }
    }

    /// The device slice, or [`OpsError::WrongBackend`] for a host buffer.
    #[cfg(feature = "cuda")]
    pub fn device(
        &self,
        op: &'static str,
        tensor: &'static str,
    ) -> Result<&cudarc::driver::CudaSlice<T>> {
        match &self.storage {
            Storage::Device(d, _) => Ok(d),
            Storage::Host(_) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cuda",
                found: "cpu",
            }),
        }
    }

    /// The device slice, mutable, or [`OpsError::WrongBackend`] for a host buffer.
    #[cfg(feature = "cuda")]
    pub fn device_mut(
        &mut self,
        op: &'static str,
        tensor: &'static str,
    ) -> Result<&mut cudarc::driver::CudaSlice<T>> {
        match &mut self.storage {
            Storage::Device(d, _) => Ok(d),
            Storage::Host(_) => Err(OpsError::WrongBackend {
                op,
                tensor,
                expected: "cuda",
                found: "cpu",
            }),
        }
    }
}

fn check_range(
    op: &'static str,
    tensor: &'static str,
    start: usize,
    len: usize,
    total: usize,
) -> Result<()> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(OpsError::Range {
            op,
            tensor,
            start,
            end: start.saturating_add(len),
            len: total,
        }),
    }
}

impl Backend {
    /// The host reference backend.
    pub fn cpu() -> Self {
        Backend::Cpu
    }

    /// `"cpu"` or `"cuda"`.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    /// True for the host backend.
    pub fn is_cpu(&self) -> bool {
        matches!(self, Backend::Cpu)
    }

    /// A buffer of `len` zero elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => Ok(Buffer::from_vec(vec![T::default(); len])),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.zeros(len),
        }
    }

    /// A buffer of `len` copies of `value`.
    pub fn filled<T: Element>(&self, len: usize, value: T) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => Ok(Buffer::from_vec(vec![value; len])),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => self.upload(&vec![value; len]),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<Buffer<T>> {
        match self {
            Backend::Cpu => Ok(Buffer::from_vec(data.to_vec())),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.upload(data),
        }
    }

    /// All elements of `buf`, copied to the host (synchronizes).
    pub fn download<T: Element>(&self, buf: &Buffer<T>) -> Result<Vec<T>> {
        self.read(buf, 0, buf.len())
    }

    /// Elements `offset..offset+len` of `buf`, copied to the host (synchronizes).
    pub fn read<T: Element>(&self, buf: &Buffer<T>, offset: usize, len: usize) -> Result<Vec<T>> {
        check_range("read", "buf", offset, len, buf.len())?;
        match self {
            Backend::Cpu => Ok(buf.host("read", "buf")?[offset..offset + len].to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.read(buf, offset, len),
        }
    }

    /// Overwrite elements `offset..offset+data.len()` of `buf` with `data`.
    pub fn write<T: Element>(&self, buf: &mut Buffer<T>, offset: usize, data: &[T]) -> Result<()> {
        check_range("write", "buf", offset, data.len(), buf.len())?;
        match self {
            Backend::Cpu => {
                buf.host_mut("write", "buf")?[offset..offset + data.len()].copy_from_slice(data);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.write(buf, offset, data),
        }
    }

    /// Copy `len` elements from `src[src_offset..]` to `dst[dst_offset..]` on this backend.
    pub fn copy<T: Element>(
        &self,
        src: &Buffer<T>,
        src_offset: usize,
        dst: &mut Buffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy", "src", src_offset, len, src.len())?;
        check_range("copy", "dst", dst_offset, len, dst.len())?;
        match self {
            Backend::Cpu => {
                let s = src.host("copy", "src")?;
                let d = dst.host_mut("copy", "dst")?;
                d[dst_offset..dst_offset + len].copy_from_slice(&s[src_offset..src_offset + len]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.copy(src, src_offset, dst, dst_offset, len),
        }
    }

    /// Set every element of `buf` to `value`.
    pub fn fill<T: Element>(&self, buf: &mut Buffer<T>, value: T) -> Result<()> {
        match self {
            Backend::Cpu => {
                buf.host_mut("fill", "buf")?.fill(value);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => {
                let n = buf.len();
                c.write(buf, 0, &vec![value; n])
            }
        }
    }

    /// Wait until all work queued on this backend has finished (a no-op on the CPU).
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Backend::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.synchronize(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_buffer_round_trip_and_ranges() {
        let be = Backend::cpu();
        let mut b = be.upload(&[1i32, 2, 3, 4]).expect("upload");
        be.write(&mut b, 1, &[9, 8]).expect("write");
        assert_eq!(be.download(&b).expect("download"), vec![1, 9, 8, 4]);
        assert!(matches!(
            be.write(&mut b, 3, &[1, 2]),
            Err(OpsError::Range {
                start: 3,
                end: 5,
                len: 4,
                ..
            })
        ));
        let mut c = be.zeros::<i32>(4).expect("zeros");
        be.copy(&b, 1, &mut c, 2, 2).expect("copy");
        assert_eq!(be.download(&c).expect("download"), vec![0, 0, 9, 8]);
        assert!(be.copy(&b, 3, &mut c, 0, 2).is_err());
        assert_eq!(
            be.download(&c).expect("download"),
            vec![0, 0, 9, 8],
            "refused copy wrote nothing"
        );
        assert_eq!(be.read(&b, 2, 2).expect("read"), vec![8, 4]);
        assert!(
            be.read(&b, usize::MAX, 2).is_err(),
            "overflowing range is refused"
        );
    }
}
