//! Metadata values and their GGUF type ids.

/// A GGUF metadata value. Variants are in GGUF type id order (0 = `U8` ... 12 = `F64`).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type id 0.
    U8(u8),
    /// Type id 1.
    I8(i8),
    /// Type id 2.
    U16(u16),
    /// Type id 3.
    I16(i16),
    /// Type id 4.
    U32(u32),
    /// Type id 5.
    I32(i32),
    /// Type id 6.
    F32(f32),
    /// Type id 7.
    Bool(bool),
    /// Type id 8: UTF-8 text.
    Str(String),
    /// Type id 9: elements all of one type (which may itself be `Array`).
    Array(Vec<Value>),
    /// Type id 10.
    U64(u64),
    /// Type id 11.
    I64(i64),
    /// Type id 12.
    F64(f64),
}

/// GGUF type id of [`Value::Str`].
pub(crate) const TYPE_STR: u32 = 8;
/// GGUF type id of [`Value::Array`].
pub(crate) const TYPE_ARRAY: u32 = 9;

/// The name of each type id, indexed by id.
const TYPE_NAMES: [&str; 13] = [
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
];

/// `"array of <type>"` for each element type id; static so that [`crate::GgufError::WrongType`]
/// can carry it without allocating.
const ARRAY_TYPE_NAMES: [&str; 13] = [
    "array of u8",
    "array of i8",
    "array of u16",
    "array of i16",
    "array of u32",
    "array of i32",
    "array of f32",
    "array of bool",
    "array of string",
    "array of array",
    "array of u64",
    "array of i64",
    "array of f64",
];

impl Value {
    /// The GGUF type id (0..=12).
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => TYPE_STR,
            Value::Array(_) => TYPE_ARRAY,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The type's name as error messages print it: `u32`, `string`, `array of f32`, ...
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Array(items) => match items.first() {
                Some(first) => ARRAY_TYPE_NAMES[first.type_id() as usize],
                None => "empty array",
            },
            other => TYPE_NAMES[other.type_id() as usize],
        }
    }

    /// The value of any integer variant, widened; `None` for other variants (booleans
    /// included: GGUF keeps them apart from integers).
    pub fn as_integer(&self) -> Option<i128> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::I8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::U64(v) => Some(v.into()),
            Value::I64(v) => Some(v.into()),
            _ => None,
        }
    }

    /// The value of `F32` or `F64` (narrowed); `None` for other variants.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// The text of a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value of a `Bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements of an `Array`.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }

    /// Whether every array in the value holds elements of one type, as GGUF requires
    /// (nested arrays may differ from each other in element type).
    pub fn is_homogeneous(&self) -> bool {
        match self {
            Value::Array(items) => {
                let first = items.first().map(Value::type_id);
                items
                    .iter()
                    .all(|item| Some(item.type_id()) == first && item.is_homogeneous())
            }
            _ => true,
        }
    }
}

macro_rules! impl_from {
    ($($ty:ty => $variant:ident),* $(,)?) => {
        $(impl From<$ty> for Value {
            fn from(v: $ty) -> Value {
                Value::$variant(v)
            }
        })*
    };
}

impl_from!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => Str, u64 => U64, i64 => I64, f64 => F64,
);

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::Str(s.to_owned())
    }
}

impl<T: Into<Value>> From<Vec<T>> for Value {
    fn from(items: Vec<T>) -> Value {
        Value::Array(items.into_iter().map(Into::into).collect())
    }
}
