//! Host buffers a collective reads in place ([`SendBuf`]) or writes its output into
//! ([`RecvBuf`]): a `Vec<T>`, or storage another owner keeps alive (a tensor's, a pool's), so a
//! collective moves each byte once, from the inputs straight into the output.

/// A read-only host buffer a collective reads in place. The collective keeps it (and so its
/// storage) alive until every rank has read it.
pub trait SendBuf<T>: Send + Sync + 'static {
    /// The elements.
    fn as_slice(&self) -> &[T];
    /// The caller's logical shape of the elements (by default flat): checked to agree across
    /// ranks and named in errors.
    fn shape(&self) -> Vec<usize> {
        vec![self.as_slice().len()]
    }
}

impl<T: Send + Sync + 'static> SendBuf<T> for Vec<T> {
    fn as_slice(&self) -> &[T] {
        self
    }
}

/// A host buffer a collective writes its whole output into, handed back by the wait.
pub trait RecvBuf<T>: Send + 'static {
    /// The elements, every one of which the collective overwrites.
    fn as_mut_slice(&mut self) -> &mut [T];
    /// The elements, to read the output.
    fn as_slice(&self) -> &[T];
}

impl<T: Send + 'static> RecvBuf<T> for Vec<T> {
    fn as_mut_slice(&mut self) -> &mut [T] {
        self
    }
    fn as_slice(&self) -> &[T] {
        self
    }
}

/// A type-erased [`SendBuf`], as the local transport keeps a post.
pub(crate) type BoxedSendBuf<T> = Box<dyn SendBuf<T>>;

impl<T: 'static> SendBuf<T> for Box<dyn SendBuf<T>> {
    fn as_slice(&self) -> &[T] {
        (**self).as_slice()
    }
    fn shape(&self) -> Vec<usize> {
        (**self).shape()
    }
}

/// Where each peer's elements start, given the counts in peer order.
pub(crate) fn displacements(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}
