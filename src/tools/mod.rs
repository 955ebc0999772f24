//! The tools built on the library, beside its layers rather than among them: the independent
//! [`oracle`], the cross-executor [`check`] and [`check_ops`], hostile input ([`fuzz`]),
//! corruption injection ([`inject`]), throughput ([`bench`](mod@bench)) and the support
//! [`matrix`]. They use the public layers only; no layer imports them.

pub mod bench;
pub mod check;
pub mod check_ops;
pub mod fuzz;
pub mod inject;
pub mod matrix;
pub mod oracle;
