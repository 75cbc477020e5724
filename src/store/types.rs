//! How [`JobId`] and [`JobState`] travel to and from Postgres, and `FromRow` for the rows the
//! statements return.
//!
//! Written out rather than derived: sqlx's derives live in its proc-macro crate, which turns on
//! its compile-time query checking and so compiles sqlx's Postgres driver, rustls and tokio a
//! second time, for the host, in every build (BENCHMARKS.md, round 10).

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use crate::job::{JobId, JobState};

/// A `JobId` is the `bigint` it wraps.
impl Type<Postgres> for JobId {
    fn type_info() -> PgTypeInfo {
        <i64 as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <i64 as Type<Postgres>>::compatible(ty)
    }
}

impl PgHasArrayType for JobId {
    fn array_type_info() -> PgTypeInfo {
        <i64 as PgHasArrayType>::array_type_info()
    }
}

impl Encode<'_, Postgres> for JobId {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<Postgres>>::encode_by_ref(&self.0, buf)
    }

    fn size_hint(&self) -> usize {
        <i64 as Encode<Postgres>>::size_hint(&self.0)
    }
}

impl<'r> Decode<'r, Postgres> for JobId {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        <i64 as Decode<Postgres>>::decode(value).map(JobId)
    }
}

/// A `JobState` is a label of the enum `rowq.job_state`.
const JOB_STATE_TYPE: &str = "rowq.job_state";

impl Type<Postgres> for JobState {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_name(JOB_STATE_TYPE)
    }
}

impl PgHasArrayType for JobState {
    fn array_type_info() -> PgTypeInfo {
        PgTypeInfo::array_of(JOB_STATE_TYPE)
    }
}

impl Encode<'_, Postgres> for JobState {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <&str as Encode<Postgres>>::encode(self.as_str(), buf)
    }

    fn size_hint(&self) -> usize {
        self.as_str().len()
    }
}

impl<'r> Decode<'r, Postgres> for JobState {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(<&str as Decode<Postgres>>::decode(value)?.parse()?)
    }
}

/// `sqlx::FromRow` for a struct whose fields are the columns of the same name, or of the
/// name given as `field = "column"`: what `#[derive(sqlx::FromRow)]` writes.
macro_rules! from_row {
    ($row:ident { $($field:ident $(= $column:literal)?),* $(,)? }) => {
        impl<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> for $row {
            fn from_row(row: &'r sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
                use sqlx::Row as _;
                Ok($row { $($field: row.try_get($crate::store::types::from_row!(@column $field $(= $column)?))?),* })
            }
        }
    };
    (@column $field:ident = $column:literal) => { $column };
    (@column $field:ident) => { stringify!($field) };
}
pub(crate) use from_row;
